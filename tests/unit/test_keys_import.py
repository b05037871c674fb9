"""`fairshare keys import` (an existing key read on standard input, only its digest stored) and
`fairshare keys create|import|list` finding the `fairshare up` state directory by themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fairshare.config import default_state_dir, load_keys
from gateway.auth import TenantDirectory, check_imported_key, key_digest

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-proj-Abc123_from-another-gateway-0123456789"


def keys(args: list[str], state: Path, stdin: str | None = None, cwd: Path | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAIRSHARE_")}
    env["FAIRSHARE_STATE_DIR"] = str(state)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "fairshare.cli", "keys", *args], input=stdin, capture_output=True,
                          text=True, env=env, cwd=cwd or state, timeout=60)


@pytest.fixture
def state(tmp_path):
    (tmp_path / "tenants.yaml").write_text("tenants:\n  - id: acme\n  - id: globex\n")
    (tmp_path / "secret").write_text("the-server-secret\n")
    return tmp_path


def test_import_reads_the_key_on_stdin_and_stores_only_its_digest(state):
    r = keys(["import", "--tenant", "acme"], state, stdin=KEY + "\n")
    assert r.returncode == 0, r.stderr
    assert KEY not in r.stdout + r.stderr  # never echoed
    stored = (state / "tenants.keys.yaml").read_text()
    assert KEY not in stored
    (record,) = load_keys(state / "tenants.keys.yaml").keys
    assert record.tenant == "acme" and record.digest == key_digest(b"the-server-secret", KEY)
    # the gateway authenticates the imported key as the tenant
    d = TenantDirectory(b"the-server-secret", state / "tenants.yaml", state / "tenants.keys.yaml")
    assert d.authenticate(f"Bearer {KEY}").tenant.id == "acme"


def test_import_refuses_a_key_stored_already_and_bad_keys(state):
    assert keys(["import", "--tenant", "acme"], state, stdin=KEY).returncode == 0
    r = keys(["import", "--tenant", "globex"], state, stdin=KEY)
    assert r.returncode == 2 and "already stored" in r.stderr
    for bad in ("", "short", "two words in a key here", "sk-" + "é" * 20):
        r = keys(["import", "--tenant", "acme"], state, stdin=bad)
        assert r.returncode == 2 and r.stderr.strip(), bad
    r = keys(["import", "--tenant", "nobody"], state, stdin="x" * 32)
    assert r.returncode == 2 and "nobody" in r.stderr
    assert len(load_keys(state / "tenants.keys.yaml").keys) == 1


def test_a_key_on_the_command_line_is_refused(state):
    r = keys(["import", "--tenant", "acme", KEY], state)
    assert r.returncode == 2 and not (state / "tenants.keys.yaml").exists()


def test_create_and_list_find_the_state_directory(state, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("cwd")
    r = keys(["create", "--tenant", "globex"], state, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert key.startswith("sk-fs-") and str(state / "tenants.yaml") in r.stderr
    d = TenantDirectory(b"the-server-secret", state / "tenants.yaml", state / "tenants.keys.yaml")
    assert d.authenticate(f"Bearer {key}").tenant.id == "globex"  # the secret next to tenants.yaml was used
    listed = keys(["list"], state, cwd=elsewhere)
    assert listed.returncode == 0 and "globex" in listed.stdout


def test_without_a_state_directory_the_tenants_file_is_required(tmp_path):
    r = keys(["list"], tmp_path / "empty", cwd=tmp_path)
    assert r.returncode == 2 and "--tenants" in r.stderr


def test_default_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FAIRSHARE_STATE_DIR", str(tmp_path / "s"))
    assert default_state_dir() == tmp_path / "s"
    monkeypatch.delenv("FAIRSHARE_STATE_DIR")
    monkeypatch.chdir(ROOT)
    assert default_state_dir() == ROOT / "var"


def test_check_imported_key():
    assert check_imported_key("  " + KEY + "\n") == KEY
    with pytest.raises(ValueError):
        check_imported_key("a" * 1025)
