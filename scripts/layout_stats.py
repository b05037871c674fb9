"""Print lines per package, the largest file and the largest function of each (the layout's size table).

    python scripts/layout_stats.py [ROOT]

ROOT defaults to the repository root (give another checkout, e.g. ``git archive 40199be | tar -x -C
/tmp/before``, for the "before" figures). Lines are physical lines of a package's ``.py`` files
(generated stubs in ``fairshare/v1`` left out); "fairshare (shared)" also leaves out ``fairshare/cli``;
"worker (all)" includes its sub-packages. The last two rows count files by what they hold wherever they
live (benchmarks, report writers). The largest function is the longest ``def`` / ``async def``
(``end_lineno - lineno + 1``, decorators excluded), nested ones included. Rows whose directory does not
exist print ``-``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# (row label, directory, directories left out of it)
ROWS = [
    ("gateway", "gateway", ()),
    ("worker (all)", "worker", ()),
    ("worker/scheduling", "worker/scheduling", ()),
    ("worker/engine", "worker/engine", ()),
    ("loadtests/sim", "loadtests/sim", ()),
    ("fairshare (shared)", "fairshare", ("fairshare/v1", "fairshare/cli")),
    ("fairshare/cli", "fairshare/cli", ()),
    ("loadtests (all)", "loadtests", ()),
    ("loadtests/bench", "loadtests/bench", ()),
    ("loadtests/reports", "loadtests/reports", ()),
]
# rows by what the files hold, wherever they live: benchmarks (``*bench*.py``, the side-channel bench and
# `loadtests/bench`) and the simulator's report writers (``*report*.py`` outside tests)
PATTERN_ROWS = [
    ("benchmarks (anywhere)", lambda r: ("bench" in r.rsplit("/", 1)[-1] and not r.startswith("fairshare/cli/"))
     or r.startswith("loadtests/bench/")
     or r == "loadtests/sidechannel.py"),  # where the side-channel bench lived before the layout change
    ("report writers (anywhere)", lambda r: "report" in r.rsplit("/", 1)[-1] or r.startswith("loadtests/reports/")),
]
SKIP = ("fairshare/v1",)


def _files(root: Path, rel: str, leave_out: tuple[str, ...]) -> list[Path]:
    base = root / rel
    if not base.is_dir():
        return []
    out = []
    for p in sorted(base.rglob("*.py")):
        r = p.relative_to(root).as_posix()
        if any(r.startswith(s + "/") for s in SKIP + leave_out):
            continue
        out.append(p)
    return out


def _largest_function(path: Path) -> tuple[int, str]:
    """(lines, name) of the longest function in `path`; (0, "") when it has none."""
    best = (0, "")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > best[0]:
                best = (n, node.name)
    return best


def table(root: Path) -> list[tuple[str, ...]]:
    """One row per package: (label, files, lines, largest file (lines), largest function (lines))."""
    every = [p for d in ("fairshare", "gateway", "worker", "loadtests") for p in _files(root, d, ())]
    groups = [(label, _files(root, rel, leave_out)) for label, rel, leave_out in ROWS]
    groups += [(label, [p for p in every if keep(p.relative_to(root).as_posix())]) for label, keep in PATTERN_ROWS]
    rows = []
    for label, files in groups:
        if not files:
            rows.append((label, "-", "-", "-", "-"))
            continue
        sizes = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in files}
        big = max(sizes, key=sizes.get)
        funcs = [(*_largest_function(p), p) for p in files]
        n, name, where = max(funcs, key=lambda t: t[0])
        rows.append((label, str(len(files)), str(sum(sizes.values())),
                     f"{big.relative_to(root).as_posix()} ({sizes[big]})",
                     f"{where.relative_to(root).as_posix()}:{name} ({n})" if n else "-"))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the table as Markdown; returns 0."""
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    head = ("package", "files", "lines", "largest file (lines)", "largest function (lines)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in table(root):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
