"""The suite's skip rule: in CI nothing skips except what needs CUDA (BRIEF, "How we build").

A skip is allowed only when it is about CUDA or a GPU: its condition or reason mentions "cuda" or
"gpu", or it sits inside an ``if`` whose test does. The one other form allowed is the CI guard that
`tests.support.skips.require` uses: a skip directly preceded by ``if <CI is set>: pytest.fail(...)``,
so CI fails where a developer's partial install skips.

Two checks apply it:
- `find_violations(source)`: static, over a test file's AST: calls of ``pytest.skip``,
  ``pytest.importorskip``, ``pytest.mark.skip`` / ``skipif`` (called or bare), ``unittest.skip*`` and
  ``raise unittest.SkipTest`` / ``pytest.skip.Exception``, however imported or aliased
  (tests/unit/test_skip_rule.py runs it over every file under tests/).
- `skip_allowed_in_ci(reason)`: at run time, tests/conftest.py turns a skip whose reason does not
  name CUDA/GPU into a failure when CI is set (for skips the static check cannot see).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

_GPU = re.compile(r"cuda|gpu", re.IGNORECASE)
_SKIP_CALLS = {"pytest.skip", "pytest.importorskip", "pytest.mark.skip", "pytest.mark.skipif",
               "unittest.skip", "unittest.skipIf", "unittest.skipUnless"}
_SKIP_RAISES = {"pytest.skip.Exception", "unittest.SkipTest", "pytest.skip.Skipped"}
_CI_TEST = re.compile(r"\bin_ci\b|[\"']CI[\"']")


@dataclass(frozen=True)
class Violation:
    line: int
    what: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}: {self.text}"


def skip_allowed_in_ci(reason: str | None) -> bool:
    """Whether a skip with this reason may happen in CI (it names CUDA or a GPU)."""
    return bool(reason) and bool(_GPU.search(reason))


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name for `import pytest as pt`, `from pytest import skip, mark`, etc."""
    names = {"pytest": "pytest", "unittest": "unittest"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("pytest", "unittest"):
                    names[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("pytest", "unittest", "_pytest.outcomes"):
            module = "pytest" if node.module == "_pytest.outcomes" else node.module
            for a in node.names:
                names[a.asname or a.name] = f"{module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _mentions_gpu(node: ast.AST) -> bool:
    return bool(_GPU.search(ast.unparse(node)))


def _is_ci_fail_guard(stmt: ast.stmt, aliases: dict[str, str]) -> bool:
    """``if <mentions CI>: ... pytest.fail(...)``."""
    if not isinstance(stmt, ast.If) or not _CI_TEST.search(ast.unparse(stmt.test)):
        return False
    return any(isinstance(n, ast.Call) and _dotted(n.func, aliases) == "pytest.fail"
               for s in stmt.body for n in ast.walk(s))


def find_violations(source: str) -> list[Violation]:
    """Skips in `source` (a Python file) that the rule does not allow, in line order."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def allowed(node: ast.AST) -> bool:
        if _mentions_gpu(node):
            return True
        child, parent = node, parents.get(node)
        while parent is not None:
            if isinstance(parent, ast.If) and child is not parent.test and _mentions_gpu(parent.test):
                return True
            body = getattr(parent, "body", None)
            if isinstance(body, list) and child in body:
                i = body.index(child)
                if i > 0 and _is_ci_fail_guard(body[i - 1], aliases):
                    return True
            child, parent = parent, parents.get(parent)
        return False

    out = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Call) and _dotted(node.func, aliases) in _SKIP_CALLS:
            what = _dotted(node.func, aliases)
        elif isinstance(node, ast.Attribute) and _dotted(node, aliases) in ("pytest.mark.skip", "pytest.mark.skipif"):
            parent = parents.get(node)
            if not (isinstance(parent, ast.Call) and parent.func is node):  # bare @pytest.mark.skip
                what = _dotted(node, aliases)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if _dotted(exc, aliases) in _SKIP_RAISES:
                what = "raise " + _dotted(exc, aliases)
        if what is not None and not allowed(node):
            out.append(Violation(node.lineno, what, ast.unparse(node).splitlines()[0][:120]))
    return sorted(out, key=lambda v: v.line)
