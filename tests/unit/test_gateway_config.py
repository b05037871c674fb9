"""Tenant config schema, key storage (HMAC digests only) and the `fairshare keys` command."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fairshare.config import Tier, TenantsFile, default_keys_path, load_keys, load_tenants
from gateway.auth import TenantDirectory, bearer_key, create_key, key_digest, revoke_key
from gateway.config import GatewaySettings
from gateway.errors import APIError

ROOT = Path(__file__).resolve().parents[2]

TENANTS = """
tenants:
  - id: acme
    weight: 2.5
    tier: batch
    limits: {rpm: 60, tpm: 1000, max_inflight_tokens: 500, max_concurrent_requests: 2}
    allowed_models: [random-tiny]
  - id: globex
"""


def test_tenants_file_parses_and_defaults(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text(TENANTS)
    t = load_tenants(p).by_id()
    assert t["acme"].weight == 2.5 and t["acme"].tier is Tier.BATCH
    assert t["acme"].limits.tpm == 1000 and t["acme"].limits.max_concurrent_requests == 2
    assert t["acme"].may_use("random-tiny") and not t["acme"].may_use("other")
    g = t["globex"]
    assert g.weight == 1.0 and g.tier is Tier.INTERACTIVE and g.limits.rpm is None and g.may_use("anything")


def test_tenants_mapping_form():
    tf = TenantsFile.model_validate({"tenants": {"a": {"weight": 3}, "b": None}})
    assert [t.id for t in tf.tenants] == ["a", "b"] and tf.tenants[0].weight == 3


@pytest.mark.parametrize("bad", [
    {"tenants": [{"id": "a"}, {"id": "a"}]},                      # duplicate id
    {"tenants": [{"id": "a{b}"}]},                                # would break the Redis hash tag
    {"tenants": [{"id": "a", "weight": 0}]},                      # weight must be > 0
    {"tenants": [{"id": "a", "tier": "gold"}]},                   # unknown tier
    {"tenants": [{"id": "a", "limits": {"tpm": -5}}]},            # negative limit
    {"tenants": [{"id": "a", "limits": {"tokens": 5}}]},          # unknown limit name
    {"tenants": [{"id": "a", "api_key_digests": ["sk-plain"]}]},  # a plain key is not a digest
])
def test_tenants_file_rejects(bad):
    with pytest.raises(ValidationError):
        TenantsFile.model_validate(bad)


def test_default_keys_path():
    assert default_keys_path("/x/tenants.yaml") == Path("/x/tenants.keys.yaml")


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("FAIRSHARE_WORKERS", "127.0.0.1:1, 127.0.0.1:2")
    monkeypatch.setenv("FAIRSHARE_SECRET", "s3cret")
    monkeypatch.setenv("FAIRSHARE_LEASE_TTL_S", "7.5")
    s = GatewaySettings()
    assert s.workers == ["127.0.0.1:1", "127.0.0.1:2"]
    assert s.secret_bytes() == b"s3cret" and s.lease_ttl_s == 7.5
    monkeypatch.setenv("FAIRSHARE_WORKERS", '["h:1", "h:2"]')
    assert GatewaySettings().workers == ["h:1", "h:2"]
    assert GatewaySettings(workers="a:1,b:2").workers == ["a:1", "b:2"]


def test_settings_without_secret_refuse(monkeypatch):
    monkeypatch.delenv("FAIRSHARE_SECRET", raising=False)
    monkeypatch.delenv("FAIRSHARE_SECRET_FILE", raising=False)
    with pytest.raises(RuntimeError, match="secret"):
        GatewaySettings().secret_bytes()


def test_keys_are_stored_as_digests_only(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text(TENANTS)
    keys = tmp_path / "tenants.keys.yaml"
    key, rec = create_key(b"secret-1", "acme", keys, load_tenants(p))
    assert key.startswith("sk-fs-") and len(key) > 40
    text = keys.read_text()
    assert key not in text and key[6:] not in text
    assert rec.digest == key_digest(b"secret-1", key) and rec.digest in text
    assert key_digest(b"secret-2", key) != rec.digest  # keyed by the server secret
    with pytest.raises(KeyError):
        create_key(b"secret-1", "nobody", keys, load_tenants(p))
    assert revoke_key(keys, rec.key_id) and not load_keys(keys).keys


def test_directory_authenticates_to_the_right_tenant(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text(TENANTS)
    keys = tmp_path / "k.yaml"
    ka, _ = create_key(b"s", "acme", keys)
    kg, _ = create_key(b"s", "globex", keys)
    d = TenantDirectory(b"s", p, keys)
    assert d.authenticate(f"Bearer {ka}").tenant.id == "acme"
    assert d.authenticate(f"bearer {kg}").tenant.id == "globex"
    for header in (None, "", "Bearer ", f"Basic {ka}"):
        with pytest.raises(APIError) as e:
            d.authenticate(header)
        assert e.value.status == 401 and e.value.code == "missing_api_key"
    for header in (f"Bearer {ka}x", f"Bearer {ka[:-1]}", "Bearer sk-fs-nothing"):
        with pytest.raises(APIError) as e:
            d.authenticate(header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
        assert ka not in e.value.message
    # a directory under another secret accepts none of these keys
    with pytest.raises(APIError):
        TenantDirectory(b"other", p, keys).authenticate(f"Bearer {ka}")


def test_directory_reloads_new_keys(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text(TENANTS)
    keys = tmp_path / "k.yaml"
    d = TenantDirectory(b"s", p, keys, reload_interval_s=0.0)
    k, _ = create_key(b"s", "acme", keys)
    assert d.authenticate(f"Bearer {k}").tenant.id == "acme"


@pytest.mark.parametrize("broken", ["tenants: [ {\n", "tenants:\n  - id: acme\n    weight: -1\n", None])
def test_broken_tenants_file_keeps_the_old_config_and_is_logged_once(tmp_path, caplog, broken):
    """A malformed (or deleted) tenants file: the previous tenants keep working, the error is logged
    as one line without a traceback, once per edit (not on every request), and a fixed file is
    picked up again."""
    p = tmp_path / "tenants.yaml"
    p.write_text(TENANTS)
    keys = tmp_path / "k.yaml"
    k, _ = create_key(b"s", "acme", keys)
    d = TenantDirectory(b"s", p, keys, reload_interval_s=0.0)
    if broken is None:
        p.unlink()
    else:
        p.write_text(broken)
    with caplog.at_level(logging.INFO, logger="fairshare.gateway"):
        for _ in range(5):
            assert d.authenticate(f"Bearer {k}").tenant.id == "acme"
    errors = [r for r in caplog.records if "could not reload" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is None and "\n" not in errors[0].getMessage()
    p.write_text(TENANTS.replace("weight: 2.5", "weight: 4"))
    assert d.authenticate(f"Bearer {k}").tenant.weight == 4


def test_inline_digests(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text(yaml.safe_dump({"tenants": [{"id": "x", "api_key_digests": [key_digest(b"s", "sk-inline-1")]}]}))
    assert TenantDirectory(b"s", p, None).authenticate("Bearer sk-inline-1").tenant.id == "x"


def test_bearer_key():
    assert bearer_key("Bearer  abc ") == "abc" and bearer_key("Token abc") is None


def test_keys_cli_prints_key_once_and_stores_digest(tmp_path):
    p = tmp_path / "tenants.yaml"
    p.write_text(TENANTS)
    secret = tmp_path / "secret"
    cmd = [sys.executable, "-m", "fairshare.cli", "keys", "create", "--tenant", "acme", "--tenants", str(p),
           "--secret-file", str(secret)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sk-fs-")
    key = lines[0]
    assert secret.exists() and (secret.stat().st_mode & 0o077) == 0
    stored = (tmp_path / "tenants.keys.yaml").read_text()
    assert key not in stored
    d = TenantDirectory(secret.read_text().strip().encode(), p, tmp_path / "tenants.keys.yaml")
    assert d.authenticate(f"Bearer {key}").tenant.id == "acme"
    bad = subprocess.run(cmd[:6] + ["nobody"] + cmd[7:], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == "" and "unknown tenant" in bad.stderr
