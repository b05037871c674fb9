"""Every non-Python file inside a serving package is shipped by a non-editable install (the
Docker images run `pip install .`): pyproject.toml's ``[tool.setuptools.package-data]`` names it.
Without it the gateway image lacks its Lua scripts and fails at import."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fairshare", "gateway", "worker", "loadtests")


def test_every_data_file_in_a_package_is_declared_as_package_data():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*"):
            if not f.is_file() or f.suffix in (".py", ".pyi", ".pyc") or "__pycache__" in f.parts:
                continue
            rel = f.relative_to(ROOT / pkg)
            if not any(rel.match(pattern) for pattern in declared.get(pkg, [])):
                missing.append(f"{pkg}/{rel}")
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
