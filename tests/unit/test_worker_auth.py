"""fairshare/worker_auth.py: tokens, key rings, verification (no network)."""

from __future__ import annotations

import pytest

from fairshare import worker_auth as wa

KEYS = wa.WorkerKeys.parse("new:" + "a" * 32 + "\nold:" + "b" * 32 + "  # the previous key")
CLAIMS = wa.Claims("Generate", "chatcmpl-1", "acme", 1, 2.0, "salt")


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_keys_parse_and_refuse_bad_entries():
    assert KEYS.ids == ["new", "old"] and KEYS.signing == ("new", b"a" * 32)
    assert wa.WorkerKeys.parse("k1=" + "x" * 16 + ", k2:" + "y" * 16).ids == ["k1", "k2"]
    for bad in ("", "# only a comment", "k1:short", "k1 " + "x" * 20, "k/1:" + "x" * 20,
                "k:" + "x" * 20 + ",k:" + "y" * 20):
        with pytest.raises(wa.KeysError):
            wa.WorkerKeys.parse(bad)


def test_token_binds_every_claim():
    clock = Clock()
    signer, verifier = wa.Signer(KEYS, clock=clock), wa.Verifier(KEYS, clock=clock)
    token = signer.token(CLAIMS)
    for field, value in (("method", "Abort"), ("request_id", "chatcmpl-2"), ("tenant", "evil"), ("tier", 3),
                         ("weight", 2.5), ("salt", "other")):
        changed = wa.Claims(**{**CLAIMS.__dict__, field: value})
        with pytest.raises(wa.AuthError) as err:
            verifier.check(token, changed)
        assert err.value.reason == "bad_signature", field
    verifier.check(token, CLAIMS)  # the true claims pass (once)
    assert verifier.failures["bad_signature"] == 6 and verifier.accepted == 1


def test_expiry_replay_and_memory():
    clock = Clock()
    signer, verifier = wa.Signer(KEYS, ttl_s=30, clock=clock), wa.Verifier(KEYS, clock=clock, skew_s=5)
    token = signer.token(CLAIMS)
    clock.t += 36  # past expiry + skew
    with pytest.raises(wa.AuthError) as err:
        verifier.check(token, CLAIMS)
    assert err.value.reason == "expired"
    clock.t -= 36
    verifier.check(token, CLAIMS)
    for _ in range(2):
        with pytest.raises(wa.AuthError) as err:
            verifier.check(signer.token(CLAIMS), CLAIMS)  # even a fresh token for the same request id
        assert err.value.reason == "replayed"
    assert verifier.remembered == 1
    clock.t += 100  # the token has expired: forgotten (a replay would be refused as expired anyway)
    verifier.check(signer.token(wa.Claims("Generate", "chatcmpl-3")), wa.Claims("Generate", "chatcmpl-3"))
    assert verifier.remembered == 1
    other = wa.Claims(**{**CLAIMS.__dict__, "request_id": "x"})
    far = signer.token(other, expiry=int(clock.t + 10_000))  # a token that would outlive the memory
    with pytest.raises(wa.AuthError) as err:
        verifier.check(far, other)
    assert err.value.reason == "malformed"


def test_rotation_two_keys_accepted_first_signs():
    clock = Clock()
    old_only = wa.WorkerKeys.parse("old:" + "b" * 32)
    verifier = wa.Verifier(KEYS, clock=clock)
    verifier.check(wa.Signer(old_only, clock=clock).token(CLAIMS), CLAIMS)  # a gateway not yet rotated
    token = wa.Signer(KEYS, clock=clock).token(wa.Claims("Abort", "r"))
    assert token.split(".")[1] == "new"
    with pytest.raises(wa.AuthError) as err:
        wa.Verifier(old_only, clock=clock).check(token, wa.Claims("Abort", "r"))
    assert err.value.reason == "unknown_key"


def test_missing_and_malformed():
    verifier = wa.Verifier(KEYS)
    for token, reason in ((None, "missing"), ("", "missing"), ("fs1.new.x.y", "malformed"), ("v9.a.1.b", "malformed"),
                          ("fs1.new.123", "malformed")):
        with pytest.raises(wa.AuthError) as err:
            verifier.check(token, CLAIMS)
        assert err.value.reason == reason
    with pytest.raises(wa.AuthError) as err:  # no request id: nothing to bind the token to
        verifier.check(wa.Signer(KEYS).token(wa.Claims("Generate", "")), wa.Claims("Generate", ""))
    assert err.value.reason == "malformed"
    assert wa.token_of([("traceparent", "x"), (wa.METADATA_KEY, "tok")]) == "tok" and wa.token_of(None) is None


def test_key_file_is_reread_when_it_changes_and_kept_when_broken(tmp_path):
    path = wa.ensure_keys_file(tmp_path / "keys")
    assert path.stat().st_mode & 0o777 == 0o600
    clock = Clock(0.0)
    source = wa.KeySource(path=path, clock=clock)
    first = source.keys().ids
    assert len(first) == 1 and wa.ensure_keys_file(path).read_text() == path.read_text()  # kept as is
    path.write_text(path.read_text() + "second:" + "c" * 32 + "\n")
    assert source.keys().ids == first  # not re-read within recheck_s
    clock.t += 2
    assert source.keys().ids == [*first, "second"]
    path.write_text("garbage")
    clock.t += 2
    assert source.keys().ids == [*first, "second"] and "KID:SECRET" in source.last_error
    with pytest.raises(wa.KeysError):
        wa.KeySource(path=tmp_path / "missing")
    assert wa.KeySource.from_settings(environ={}) is None
    assert wa.KeySource.from_settings(environ={wa.KEYS_ENV: "e:" + "d" * 20}).keys().ids == ["e"]


def test_rotation_steps_on_a_keys_file(tmp_path, capsys):
    """`fairshare keys worker`: create, add (accepted, not signing), promote (signs), remove (refused)."""
    from gateway.cli import keys_main

    path = tmp_path / "worker-keys"
    assert keys_main(["worker", "--file", str(path)]) == 0
    (first,) = wa.WorkerKeys.parse(path.read_text()).ids
    assert keys_main(["worker", "--file", str(path), "--add"]) == 0
    ring = wa.WorkerKeys.parse(path.read_text())
    assert ring.ids[0] == first and len(ring.ids) == 2
    new = ring.ids[1]
    assert keys_main(["worker", "--file", str(path), "--promote", new]) == 0
    assert wa.WorkerKeys.parse(path.read_text()).ids == [new, first]
    assert keys_main(["worker", "--file", str(path), "--remove", first]) == 0
    assert wa.WorkerKeys.parse(path.read_text()).ids == [new] and path.stat().st_mode & 0o777 == 0o600
    assert keys_main(["worker", "--file", str(path), "--remove", new]) == 1  # never the last one
    assert keys_main(["worker", "--file", str(path), "--promote", "nope"]) == 1
    assert "signing key" in capsys.readouterr().err
