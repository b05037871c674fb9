"""Fixtures of the deployment tests: real helm, Compose and hadolint binaries (tests/deploy/tools.py)
and helm renderings parsed with PyYAML."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from . import tools

ROOT = tools.ROOT
CHART = ROOT / "helm" / "fairshare"
DEPLOY = ROOT / "deploy"
RELEASE = "fs"
NAMESPACE = "serving"

# The value sets the issue asks for, as extra -f files relative to the chart.
VALUE_SETS: dict[str, tuple[str, ...]] = {
    "default": (),
    "gpu": ("values-gpu.yaml",),
    "external-redis": ("values-external-redis.yaml",),
    "gpu+external-redis": ("values-gpu.yaml", "values-external-redis.yaml"),
}


def _tool(find, what: str):
    """`find()`'s result; a ToolError fails the tests that need the tool, saying which."""
    try:
        return find()
    except tools.ToolError as e:
        pytest.fail(f"{what} is required for the deployment tests: {e}", pytrace=False)


@pytest.fixture(scope="session")
def helm_bin() -> str:
    """Path of a working helm (downloaded and cached on first use; a failure fails the tests)."""
    return str(_tool(tools.helm, "helm"))


@pytest.fixture(scope="session")
def compose_cmd() -> list[str]:
    """Command prefix of a Compose v2 CLI."""
    return _tool(tools.compose, "a Compose v2 CLI")


@pytest.fixture(scope="session")
def hadolint_bin() -> str:
    """Path of a working hadolint."""
    return str(_tool(tools.hadolint, "hadolint"))


class Helm:
    """Runs helm on the chart; `render` results are cached per argument list."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self._cache: dict[tuple, list[dict]] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)

    def template_args(self, value_files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[str]:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        for f in value_files:
            args += ["-f", str(CHART / f)]
        for s in sets:
            args += ["--set", s]
        return args

    def template(self, value_files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return self.run(*self.template_args(value_files, sets))

    def render(self, value_files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[dict]:
        """The rendered manifests, parsed; fails the test when helm fails."""
        key = (value_files, sets)
        if key not in self._cache:
            res = self.template(value_files, sets)
            assert res.returncode == 0, f"helm template failed:\n{res.stderr}"
            self._cache[key] = [d for d in yaml.safe_load_all(res.stdout) if d]
        return self._cache[key]


@pytest.fixture(scope="session")
def helm(helm_bin) -> Helm:
    return Helm(helm_bin)


# -- helpers over parsed manifests ------------------------------------------------------------------

def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    """The single manifest of `kind` (and app.kubernetes.io/component, when given)."""
    found = [d for d in of_kind(docs, kind)
             if component is None or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {kind} {component or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(workload: dict, name: str) -> dict:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name} in {workload['metadata']['name']}")


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    """Whether a matchLabels selector selects pods carrying `labels`."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def load_yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)
