"""docker-compose.yml (repository root): validated by a real Compose v2 CLI (`compose config` needs no engine),
then checked structurally: profiles, health-gated start order, GPU reservation, mounts, secrets."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from fairshare.config import load_tenants

from .conftest import ROOT, load_yaml

COMPOSE_FILE = ROOT / "docker-compose.yml"
PROFILES = {"default": [], "gpu": ["--profile", "gpu"]}
LONG_RUNNING = {"redis", "worker", "worker-gpu", "gateway"}


def compose_env() -> dict[str, str]:
    """The environment without FAIRSHARE_* / COMPOSE_* overrides, so the root .env decides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAIRSHARE_", "COMPOSE_"))}
    env["DOCKER_HOST"] = "unix:///nonexistent/docker.sock"  # prove no engine is needed
    return env


_config_cache: dict[str, dict] = {}


def config(compose_cmd, profile: str) -> dict:
    """`compose config --format json` for a profile (the fully resolved model)."""
    if profile not in _config_cache:
        res = subprocess.run([*compose_cmd, "-f", str(COMPOSE_FILE), *PROFILES[profile], "config", "--format", "json"],
                             capture_output=True, text=True, timeout=60, env=compose_env(), cwd=ROOT)
        assert res.returncode == 0, res.stderr
        _config_cache[profile] = json.loads(res.stdout)
    return _config_cache[profile]


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_config_validates(compose_cmd, profile):
    res = subprocess.run([*compose_cmd, "-f", str(COMPOSE_FILE), *PROFILES[profile], "config", "--quiet"],
                         capture_output=True, text=True, timeout=60, env=compose_env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert not res.stderr.strip(), res.stderr  # no warnings (unset variables, obsolete keys)


@pytest.mark.parametrize("profile,workers", [("default", {"worker"}), ("gpu", {"worker-gpu"})])
def test_profiles_pick_one_worker(compose_cmd, profile, workers):
    services = set(config(compose_cmd, profile)["services"])
    assert services == {"redis", "init", "gateway"} | workers


@pytest.mark.parametrize("profile", PROFILES)
def test_health_gated_start_order(compose_cmd, profile):
    cfg = config(compose_cmd, profile)
    services = cfg["services"]
    for name in LONG_RUNNING & set(services):
        hc = services[name].get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL") and not hc.get("disable"), name
    deps = services["gateway"]["depends_on"]
    assert deps["redis"]["condition"] == "service_healthy"
    assert deps["init"]["condition"] == "service_completed_successfully"
    running_workers = {"worker", "worker-gpu"} & set(services)
    assert len(running_workers) == 1
    for w in running_workers:
        assert deps[w]["condition"] == "service_healthy"


@pytest.mark.parametrize("profile", PROFILES)
def test_gateway_worker_list_resolves_to_the_running_worker(compose_cmd, profile):
    services = config(compose_cmd, profile)["services"]
    workers = services["gateway"]["environment"]["FAIRSHARE_WORKERS"].split(",")
    assert workers == ["dns:///worker:50051"]  # every replica of the worker service, discovered live
    (worker_name,) = {"worker", "worker-gpu"} & set(services)
    worker = services[worker_name]
    names = {worker_name} | set(((worker.get("networks") or {}).get("default") or {}).get("aliases") or [])
    assert "worker" in names
    cmd = worker["command"]
    assert cmd[cmd.index("--port") + 1] == "50051" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert worker["healthcheck"]["test"][1:] == ["fairshare-healthcheck", "grpc", "127.0.0.1:50051",
                                                 "fairshare.v1.Worker"]
    assert not worker.get("ports"), "workers are reachable only on the compose network"
    assert not services["redis"].get("ports")
    assert [p["target"] for p in services["gateway"]["ports"]] == [8000]


def test_gpu_profile_reserves_a_gpu_and_runs_sglang(compose_cmd):
    w = config(compose_cmd, "gpu")["services"]["worker-gpu"]
    (dev,) = w["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and dev["count"] == 1
    assert w["command"][:3] == ["worker", "--engine", "sglang"]
    model = w["command"][w["command"].index("--model") + 1]
    mount = next(v for v in w["volumes"] if v["target"] == "/models")
    assert mount["read_only"] is True and model.startswith("/models/")
    assert w["build"]["dockerfile"] == "deploy/worker-gpu.Dockerfile"
    assert re.fullmatch(r"lmsysorg/sglang:v\d+\.\d+\.\d+\S*", w["build"]["args"]["SGLANG_IMAGE"])
    assert w["shm_size"] and w["image"].endswith("/worker-gpu:0.1.0")


def test_tenants_mounted_read_only_and_secrets_kept_out_of_the_file(compose_cmd):
    gw = config(compose_cmd, "default")["services"]["gateway"]
    env = gw["environment"]
    cfg = next(v for v in gw["volumes"] if v["target"] == "/etc/fairshare")
    assert cfg["type"] == "bind" and cfg["read_only"] is True
    assert env["FAIRSHARE_TENANTS_FILE"].startswith("/etc/fairshare/")
    tenants_file = os.path.join(cfg["source"], os.path.relpath(env["FAIRSHARE_TENANTS_FILE"], "/etc/fairshare"))
    assert [t.id for t in load_tenants(tenants_file).tenants] == ["acme", "globex", "nightly"]
    # keys digests and the server secret live in the writable state volume, never in the bind mount
    state = next(v for v in gw["volumes"] if v["type"] == "volume")
    for var in ("FAIRSHARE_KEYS_FILE", "FAIRSHARE_SECRET_FILE"):
        assert env[var].startswith(state["target"] + "/"), var
    assert "FAIRSHARE_SECRET" not in env
    init = config(compose_cmd, "default")["services"]["init"]
    assert env["FAIRSHARE_SECRET_FILE"] in " ".join(init["entrypoint"])
    assert any(v["type"] == "volume" and v["source"] == state["source"] for v in init["volumes"])


def test_services_are_hardened(compose_cmd):
    services = config(compose_cmd, "gpu")["services"] | config(compose_cmd, "default")["services"]
    for name, s in services.items():
        assert "no-new-privileges:true" in s.get("security_opt", []), name
        assert s.get("cap_drop") == ["ALL"], name
        assert not s.get("privileged"), name
    assert services["gateway"]["read_only"] is True and services["redis"]["read_only"] is True


def test_compose_file_structure_without_the_cli():
    """Schema-level checks on the file itself (what still holds where no Compose CLI runs)."""
    doc = load_yaml(COMPOSE_FILE)
    assert set(doc) <= {"name", "services", "volumes", "networks", "secrets", "configs"} | \
        {k for k in doc if k.startswith("x-")}
    assert "version" not in doc, "`version` is obsolete in the Compose specification"
    services = doc["services"]
    assert set(services) == {"redis", "worker", "worker-gpu", "init", "gateway", "prometheus", "grafana"}
    assert services["worker"]["profiles"] == ["cpu"] and services["worker-gpu"]["profiles"] == ["gpu"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    for name, s in services.items():
        assert set(s) & {"image", "build"}, name
        if "build" in s:
            build = s["build"]
            dockerfile = ROOT / build["dockerfile"] if (COMPOSE_FILE.parent / build["context"]).resolve() == ROOT \
                else None
            assert dockerfile is not None and dockerfile.is_file(), name
    dotenv = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    assert dotenv["COMPOSE_PROFILES"] == "cpu"
    # the named volumes used are declared
    used = {v.split(":", 1)[0] for s in services.values() for v in s.get("volumes", []) if isinstance(v, str)}
    assert {u for u in used if not u.startswith((".", "/", "$"))} <= set(doc["volumes"])
    # worker authentication: init writes the key into the state volume; the gateway signs with it and
    # every worker verifies with the same file, mounted read only, after init ran
    keys = services["gateway"]["environment"]["FAIRSHARE_WORKER_KEYS_FILE"]
    assert keys.startswith("/var/lib/fairshare/") and keys in " ".join(services["init"]["entrypoint"])
    for name in ("worker", "worker-gpu"):
        w = services[name]
        assert w["environment"]["FAIRSHARE_WORKER_KEYS_FILE"] == keys, name
        assert "state:/var/lib/fairshare:ro" in w["volumes"], name
        assert w["depends_on"]["init"]["condition"] == "service_completed_successfully", name
