"""Layers point down only (DESIGN.md, "Layout"): every import of every module is read (ast, function-local
and TYPE_CHECKING imports included, relative imports resolved) and checked against the rules below.

Layers, top to bottom:

- ``cli``: `fairshare/cli/` (the `fairshare` command line, the `up` supervisor, `top`);
- ``loadtests``: `loadtests/` (benchmarks, report writers, Locust campaigns, the `fairshare up` handle, and
  the simulator `loadtests/sim/`: the real engine on a simulated runner, and a pool of them behind the
  gateway's routing policy — a tool above both tiers, not serving code);
- serving: ``gateway`` (`gateway/`), ``worker`` (`worker/`), with
  ``scheduling`` (`worker/scheduling/`, framework-free) at its bottom;
- ``shared``: `fairshare/` outside `fairshare/cli/` (tenant schema, tiers, the gRPC contract and stubs,
  telemetry, worker authentication, workload definitions).

A failure lists every offending ``file:line`` with the import and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fairshare", "gateway", "worker", "loadtests")
GENERATED = ("fairshare/v1/",)  # protoc output: imports grpc and protobuf, nothing of ours

# source layer -> {forbidden target: why}
SERVING = ("gateway", "worker", "scheduling", "shared")
RULES: dict[str, dict[str, str]] = {
    "worker": {"gateway": "worker never imports the gateway", "loadtests": "serving code imports no benchmark",
               "cli": "the command line sits above both tiers"},
    "scheduling": {"torch": "worker/scheduling is framework-free", "grpc": "worker/scheduling is framework-free",
                   "sglang": "worker/scheduling is framework-free",
                   "worker": "worker/scheduling imports no engine or server (executors call it, not the reverse)",
                   "gateway": "worker never imports the gateway",
                   "loadtests": "serving code imports no benchmark", "cli": "the command line sits above both tiers"},
    "gateway": {"torch": "the gateway never imports torch", "sglang": "the gateway never imports an engine",
                "worker": "gateway and worker never import each other",
                "scheduling": "gateway and worker never import each other",
                "loadtests": "serving code imports no benchmark",
                "cli": "the command line sits above both tiers"},
    "shared": {"torch": "both tiers import the shared layer (the gateway never imports torch)",
               "sglang": "both tiers import the shared layer", "gateway": "the shared layer imports no tier",
               "worker": "the shared layer imports no tier", "scheduling": "the shared layer imports no tier",
               "loadtests": "serving code imports no benchmark",
               "cli": "the command line sits above both tiers"},
    "loadtests": {"cli": "the command line sits on top (it dispatches to the benchmarks, not the reverse)"},
}

# (source layer, module) -> why that layer may import it although a rule above forbids its layer. Each entry
# must still be used (test_every_exemption_is_still_used), so that it goes when the import goes.
EXEMPT: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    module: str
    source: str
    target: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.module} ({self.source} -> {self.target}: {self.why})"


# dotted prefix -> layer, most specific first (a path is turned into its module name and looked up here)
PREFIX_LAYERS = (("fairshare.cli", "cli"), ("fairshare", "shared"), ("loadtests", "loadtests"),
                 ("gateway", "gateway"), ("worker.scheduling", "scheduling"),
                 ("worker", "worker"), ("torch", "torch"), ("grpc", "grpc"), ("sglang", "sglang"))


def layer_of_module(name: str) -> str | None:
    """The layer (or the framework: torch, grpc, sglang) a dotted module name belongs to; None for others."""
    return next((layer for prefix, layer in PREFIX_LAYERS if name == prefix or name.startswith(prefix + ".")), None)


def layer_of_path(rel: str) -> str | None:
    """The layer of a repository-relative ``.py`` path; None outside the layered packages."""
    layer = layer_of_module(rel.removesuffix(".py").replace("/", "."))
    return layer if layer not in ("torch", "grpc", "sglang") else None


def _package_of(rel: str) -> list[str]:
    parts = rel[:-3].split("/")
    return parts[:-1] if parts[-1] != "__init__" else parts[:-1]


def imports_of(path: Path, rel: str) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in the file; ``from X import a`` yields ``X.a`` (a may be a
    module) and relative imports are made absolute against the file's package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), rel)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(rel)
                pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(pkg + ([base] if base else []))
            out.extend((node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names)
    return out


def python_files(root: Path) -> list[tuple[Path, str]]:
    """Every ``.py`` file of the layered packages under `root` (generated stubs left out)."""
    out = []
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if not rel.startswith(GENERATED) and "__pycache__" not in rel:
                out.append((p, rel))
    return out


def violations(root: Path, exempt: dict[tuple[str, str], str] | None = None) -> list[Violation]:
    """Every import under `root` that points up (or sideways where a rule forbids it), in file order;
    `exempt` (default `EXEMPT`): (source layer, module) pairs let through."""
    exempt = EXEMPT if exempt is None else exempt
    found = []
    for path, rel in python_files(root):
        source = layer_of_path(rel)
        rules = RULES.get(source or "", {})
        for line, module in imports_of(path, rel):
            target = layer_of_module(module)
            if target is None or target == source or target not in rules:
                continue
            if any(source == layer and (module == m or module.startswith(m + ".")) for layer, m in exempt):
                continue
            found.append(Violation(rel, line, module, source, target, rules[target]))
    return found


def test_no_layer_imports_a_higher_one():
    found = violations(ROOT)
    assert not found, f"{len(found)} import(s) point up a layer:\n" + "\n".join(map(str, found))


def test_every_exemption_is_still_used():
    raw = violations(ROOT, exempt={})
    stale = [k for k in EXEMPT if not any(v.source == k[0] and (v.module == k[1] or v.module.startswith(k[1] + "."))
                                          for v in raw)]
    assert not stale, f"these exemptions no longer match an import; remove them: {stale}"


def test_the_checker_reports_every_planted_violation_with_file_and_line(tmp_path):
    """A tree with one violation per rule kind (module-level, function-local, relative, TYPE_CHECKING):
    each is reported at its file:line, the clean imports are not."""
    files = {
        "worker/engine/bad.py": "import os\n\n\ndef f():\n    from gateway.app import create_app\n",
        "worker/cache/rel.py": "from ...loadtests.bench import cache\n",
        "worker/scheduling/core.py": "import math\nimport torch\nfrom worker.engine.sequence import Sequence\n",
        "gateway/app.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker.engine import engine\n",
        "gateway/ok.py": "from fairshare.config import Tenant\nfrom gateway import errors\n",
        "fairshare/config.py": "from fairshare.cli import up\n",
        "fairshare/tiers.py": "from fairshare import cli\n",
        "loadtests/bench/x.py": "from worker.engine.engine import Engine\nfrom fairshare.cli.up import main\n",
        "fairshare/cli/main.py": "from loadtests.bench import engine\nfrom gateway import cli\nimport worker.cli\n",
        "loadtests/sim/pool.py": "from gateway.routing_policy import PoolBoard\nfrom fairshare.cli import sim\n",
        "worker/server.py": "from loadtests.sim.runner import VirtualClock\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = {f"{v.path}:{v.line}:{v.module}" for v in violations(tmp_path, exempt={})}
    assert got == {
        "worker/engine/bad.py:5:gateway.app.create_app",
        "worker/cache/rel.py:1:loadtests.bench.cache",
        "worker/scheduling/core.py:2:torch",
        "worker/scheduling/core.py:3:worker.engine.sequence.Sequence",
        "gateway/app.py:3:worker.engine.engine",
        "fairshare/config.py:1:fairshare.cli.up",
        "fairshare/tiers.py:1:fairshare.cli",
        "loadtests/bench/x.py:2:fairshare.cli.up.main",
        "loadtests/sim/pool.py:2:fairshare.cli.sim",
        "worker/server.py:1:loadtests.sim.runner.VirtualClock",
    }
    # the simulator sits above both tiers: it may run the gateway's routing policy (no copy)
    assert "loadtests/sim/pool.py:1:gateway.routing_policy.PoolBoard" not in got
    # and the failure message names each one with its rule
    text = "\n".join(map(str, violations(tmp_path, exempt={})))
    assert "worker/engine/bad.py:5: imports gateway.app.create_app (worker -> gateway: worker never imports the gateway)" in text
