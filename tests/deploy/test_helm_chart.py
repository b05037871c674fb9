"""The Helm chart helm/fairshare: `helm lint --strict`, `helm template`, and the rendered manifests
checked with PyYAML (GPU limits, probes, secrets, NetworkPolicy, worker addresses)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from fairshare.config import TenantsFile
from gateway.auth import TenantDirectory

from .conftest import CHART, DEPLOY, NAMESPACE, ROOT, VALUE_SETS, container, env_of, of_kind, one, selects

GPU_SETS = [k for k in VALUE_SETS if "gpu" in k]
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


# -- lint and template ------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(helm, value_set):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for f in VALUE_SETS[value_set]:
        args += ["-f", str(CHART / f)]
    res = helm.run(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 chart(s) failed" in res.stdout
    assert "[WARNING]" not in res.stdout and "[ERROR]" not in res.stdout


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_template_renders_every_component(helm, value_set):
    docs = helm.render(VALUE_SETS[value_set])
    external = "external-redis" in value_set
    kinds = {(d["kind"], d["metadata"].get("labels", {}).get("app.kubernetes.io/component")) for d in docs}
    for expected in [("Deployment", "gateway"), ("Service", "gateway"), ("HorizontalPodAutoscaler", "gateway"),
                     ("PodDisruptionBudget", "gateway"), ("StatefulSet", "worker"), ("Service", "worker"),
                     ("ConfigMap", "gateway"), ("Secret", "gateway"), ("NetworkPolicy", "worker"),
                     ("NetworkPolicy", "gateway")]:
        assert expected in kinds, f"{expected} missing in {value_set}"
    assert (("Deployment", "redis") in kinds) is not external
    assert (("Service", "redis") in kinds) is not external
    for d in docs:  # every manifest is namespaced by helm and carries the chart's labels
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "fs"
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fairshare"
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "duplicate resource names"


def test_schema_is_json_schema(helm):
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"].startswith("http://json-schema.org/")
    assert schema["additionalProperties"] is False
    tenant = schema["properties"]["tenants"]["items"]
    assert tenant["additionalProperties"] is False and "api_key_digests" not in tenant["properties"]


@pytest.mark.parametrize("values,fragment", [
    ({"worker": {"engine": "vllm"}}, "/worker/engine"),
    ({"worker": {"gpu": {"count": 0}}}, "/worker/gpu/count"),
    ({"tenants": [{"id": "a", "tier": "gold"}]}, "/tenants/0/tier"),
    ({"tenants": [{"id": "a", "weight": 0}]}, "/tenants/0/weight"),
    ({"tenants": [{"id": "no spaces"}]}, "/tenants/0/id"),
    ({"tenants": [{"id": "a", "limits": {"rpm": 0}}]}, "/tenants/0/limits/rpm"),
    ({"tenants": [{"id": "a", "limits": {"rpd": 5}}]}, "rpd"),
    ({"tenants": [{"id": "a", "api_key_digests": ["ab" * 32]}]}, "api_key_digests"),
    ({"gateway": {"logLevel": "loud"}}, "/gateway/logLevel"),
    ({"redis": {"external": {"url": "http://x"}}}, "/redis/external/url"),
    ({"unknownKey": 1}, "unknownKey"),
    ({"gateway": {"metrics": {"port": 0}}}, "/gateway/metrics/port"),
    ({"worker": {"metrics": {"enabled": True, "port": 70000}}}, "/worker/metrics/port"),
    ({"worker": {"kvQuota": {"enabled": True, "watermark": 1.5}}}, "/worker/kvQuota/watermark"),
    ({"worker": {"kvQuota": {"enabled": True, "headroom": 1}}}, "/worker/kvQuota/headroom"),
    ({"worker": {"kvQuota": {"enabled": True, "hardCap": "lots"}}}, "/worker/kvQuota/hardCap"),
    ({"worker": {"kvQuota": {"enabled": True, "softQuotas": {"acme": 0}}}}, "/worker/kvQuota/softQuotas/acme"),
    ({"worker": {"kvQuota": {"enabled": True, "hardCaps": {"no spaces": 0.5}}}}, "'no spaces' does not match"),
    ({"worker": {"kvQuota": {"enable": True}}}, "enable"),
])
def test_schema_rejects_bad_values(helm, tmp_path, values, fragment):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(values))
    res = helm.template((str(f),))
    assert res.returncode != 0, f"{values} was accepted"
    assert fragment in res.stderr, res.stderr


def test_tenant_schema_matches_the_gateways(helm, tmp_path):
    """Tenants the chart accepts are valid for fairshare.config, limits and allowed models included."""
    tenants = [{"id": "acme.prod_1", "weight": 0.25, "tier": "background",
                "limits": {"rpm": 1, "tpm": 2, "max_inflight_tokens": 3, "max_concurrent_requests": 4},
                "allowed_models": ["m1", "m2"]}, {"id": "b"}]
    f = tmp_path / "tenants.yaml"
    f.write_text(yaml.safe_dump({"tenants": tenants}))
    docs = helm.render((str(f),))
    parsed = TenantsFile.model_validate(yaml.safe_load(one(docs, "ConfigMap")["data"]["tenants.yaml"]))
    assert parsed == TenantsFile.model_validate({"tenants": tenants})


def test_sglang_engine_needs_gpus(helm):
    res = helm.template(sets=("worker.engine=sglang",))
    assert res.returncode != 0 and "gpu" in res.stderr.lower()


@pytest.mark.parametrize("sets,message", [
    (("gateway.metrics.port=8000",), "gateway.metrics.port must differ"),
    (("worker.metrics.port=50051",), "worker.metrics.port must differ"),
    (("worker.kvQuota.enabled=true", "worker.kvQuota.headroom=0.6", "worker.kvQuota.sharedBuffer=0.5"),
     "headroom + sharedBuffer must be < 1"),
    (("worker.quantization=int4", "worker.dtype=float32"), "needs worker.dtype bfloat16 or auto"),
    (("worker.quantization=int8", "worker.device=cuda"), "runs on the CPU"),
])
def test_checks_the_schema_cannot_express(helm, sets, message):
    res = helm.template(sets=sets)
    assert res.returncode != 0 and message in res.stderr, res.stderr


def test_external_redis_needs_an_address(helm):
    res = helm.template(sets=("redis.enabled=false",))
    assert res.returncode != 0 and "redis.external" in res.stderr


# -- GPU workers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", GPU_SETS)
def test_gpu_workers_request_gpus_on_gpu_nodes(helm, value_set):
    docs = helm.render(VALUE_SETS[value_set])
    sts = one(docs, "StatefulSet", "worker")
    spec = pod_spec(sts)
    worker = container(sts, "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in worker["resources"].get("requests", {}) or \
        worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"].get("nvidia.com/gpu.present") == "true"
    assert any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule" for t in spec["tolerations"])
    # SGLang backend, model from the read-only model volume
    args = worker["args"]
    assert args[args.index("--engine") + 1] == "sglang"
    model = args[args.index("--model") + 1]
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    assert model.startswith(mounts["models"]["mountPath"] + "/")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert worker["image"].startswith("fairshare/worker-gpu:")


def test_default_workers_are_cpu_reference_workers(helm):
    sts = one(helm.render(), "StatefulSet", "worker")
    worker = container(sts, "worker")
    assert not any("gpu" in k for k in worker["resources"].get("limits", {}))
    assert "--engine" not in worker["args"]
    assert worker["args"][worker["args"].index("--device") + 1] == "cpu"
    assert worker["image"].startswith("fairshare/worker-cpu:")


def test_gpu_count_and_resource_name_are_values(helm):
    docs = helm.render(("values-gpu.yaml",), ("worker.gpu.count=2", "worker.gpu.resourceName=nvidia.com/mig-3g.40gb"))
    limits = container(one(docs, "StatefulSet", "worker"), "worker")["resources"]["limits"]
    assert limits["nvidia.com/mig-3g.40gb"] == 2 and "nvidia.com/gpu" not in limits


# -- probes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_container_has_probes(helm, value_set):
    docs = helm.render(VALUE_SETS[value_set])
    for w in (d for d in docs if d["kind"] in WORKLOAD_KINDS):
        for c in pod_spec(w)["containers"]:
            assert c.get("livenessProbe") and c.get("readinessProbe"), f"{w['metadata']['name']}/{c['name']}"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_uses_native_grpc_health_probes(helm, value_set):
    sts = one(helm.render(VALUE_SETS[value_set]), "StatefulSet", "worker")
    worker = container(sts, "worker")
    port = worker["args"][worker["args"].index("--port") + 1]
    grpc_port = {p["name"]: p["containerPort"] for p in worker["ports"]}["grpc"]
    assert int(port) == grpc_port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert worker[probe]["grpc"]["port"] == grpc_port, probe
    assert worker["readinessProbe"]["grpc"]["service"] == "fairshare.v1.Worker"
    assert worker["livenessProbe"]["grpc"]["service"] == ""
    # loading a model may take minutes: the startup probe must allow for it
    sp = worker["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 600


def test_gateway_http_probes(helm):
    gw = container(one(helm.render(), "Deployment", "gateway"), "gateway")
    assert {p["name"]: p["containerPort"] for p in gw["ports"]}["http"] == 8000
    assert gw["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gw["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gw["startupProbe"]["httpGet"]["path"] == "/healthz"


# -- secrets and config ----------------------------------------------------------------------------

SENTINEL_SECRET = "s3cr3t-sentinel-value-0123456789"
SENTINEL_DIGEST = "5b1d" + "e" * 60
KEYS_FILE = yaml.safe_dump({"keys": [{"key_id": "key_3f9a1c2b7d4e", "tenant": "acme", "digest": SENTINEL_DIGEST,
                                      "created": "2026-11-29T22:00:00+00:00"}]})


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_no_secret_material_in_configmaps(helm, value_set, tmp_path):
    secrets = tmp_path / "secrets.yaml"  # as `--set-file secrets.keysFile=...` would pass it
    secrets.write_text(yaml.safe_dump({"secrets": {"serverSecret": SENTINEL_SECRET, "keysFile": KEYS_FILE}}))
    docs = helm.render((*VALUE_SETS[value_set], str(secrets)))
    secret = one(docs, "Secret")
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded["server-secret"] == SENTINEL_SECRET
    assert SENTINEL_DIGEST in decoded["tenants.keys.yaml"]
    if "external-redis" in value_set:
        assert decoded["redis-url"].startswith("rediss://")
    cms = of_kind(docs, "ConfigMap")
    assert cms
    for cm in cms:
        text = yaml.safe_dump(cm)
        assert SENTINEL_SECRET not in text and SENTINEL_DIGEST not in text
        assert not re.search(r"\b[0-9a-f]{64}\b", text), "a digest-like value in a ConfigMap"
        assert "sk-fs-" not in text and "digest" not in text and "redis://" not in text and "rediss://" not in text
    # the tenants file is valid for the gateway and holds no key digests
    tenants = TenantsFile.model_validate(yaml.safe_load(one(docs, "ConfigMap")["data"]["tenants.yaml"]))
    assert [t.id for t in tenants.tenants] == ["acme", "globex"]
    assert all(not t.api_key_digests for t in tenants.tenants)
    # no workload carries a secret value in plain env
    for w in (d for d in docs if d["kind"] in WORKLOAD_KINDS):
        for c in pod_spec(w)["containers"]:
            for e in c.get("env", []):
                assert SENTINEL_SECRET not in str(e.get("value", "")), e
                assert e["name"] != "FAIRSHARE_SECRET" or "valueFrom" in e
                if "value" in e:
                    assert not str(e["value"]).startswith("rediss://"), "a Redis URL (may hold a password) in plain env"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_gateway_reads_tenants_from_configmap_and_keys_from_secret(helm, value_set):
    docs = helm.render(VALUE_SETS[value_set])
    dep = one(docs, "Deployment", "gateway")
    gw = container(dep, "gateway")
    env = env_of(gw)
    volumes = {v["name"]: v for v in pod_spec(dep)["volumes"]}
    mounts = {m["mountPath"]: m for m in gw["volumeMounts"]}

    def source_of(path: str) -> tuple[dict, str]:
        for mount_path, m in mounts.items():
            if path.startswith(mount_path.rstrip("/") + "/"):
                assert "subPath" not in m, "subPath mounts do not receive updates"
                return volumes[m["name"]], path[len(mount_path.rstrip("/")) + 1:]
        raise AssertionError(f"{path} is on no mounted volume")

    vol, key = source_of(env["FAIRSHARE_TENANTS_FILE"]["value"])
    assert vol["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    assert key in one(docs, "ConfigMap")["data"]
    secret = one(docs, "Secret")
    for var in ("FAIRSHARE_KEYS_FILE", "FAIRSHARE_SECRET_FILE"):
        vol, key = source_of(env[var]["value"])
        assert vol["secret"]["secretName"] == secret["metadata"]["name"], var
        assert key in secret["data"], var
    assert vol["secret"]["defaultMode"] & 0o007 == 0, "secret files readable by others"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_gateway_and_workers_share_the_worker_auth_keys(helm, value_set, tmp_path):
    """The gateway signs worker calls and the workers verify with the same `worker-keys` entry of the
    Secret, mounted as a whole directory (a rotated key reaches running pods), never in plain env."""
    keys = tmp_path / "secrets.yaml"
    keys.write_text(yaml.safe_dump({"secrets": {"workerKeys": "k2:" + "n" * 40 + "\nk1:" + "o" * 40}}))
    docs = helm.render((*VALUE_SETS[value_set], str(keys)))
    secret = one(docs, "Secret")
    text = base64.b64decode(secret["data"]["worker-keys"]).decode()
    from fairshare.worker_auth import WorkerKeys

    assert WorkerKeys.parse(text).ids == ["k2", "k1"]
    for kind, component in (("Deployment", "gateway"), ("StatefulSet", "worker")):
        w = one(docs, kind, component)
        c = container(w, component)
        path = env_of(c)["FAIRSHARE_WORKER_KEYS_FILE"]["value"]
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
        assert "subPath" not in mount and mount.get("readOnly")
        vol = {v["name"]: v for v in pod_spec(w)["volumes"]}[mount["name"]]
        assert vol["secret"]["secretName"] == secret["metadata"]["name"]
        item = next(i for i in vol["secret"]["items"] if i["path"] == path.rsplit("/", 1)[1])
        assert item["key"] == "worker-keys" and vol["secret"]["defaultMode"] & 0o007 == 0
        assert "n" * 40 not in yaml.safe_dump(w)
    generated = one(helm.render(VALUE_SETS[value_set]), "Secret")  # none given: one generated key
    assert len(WorkerKeys.parse(base64.b64decode(generated["data"]["worker-keys"]).decode()).ids) == 1


def test_existing_secret_is_used_instead_of_the_charts(helm):
    docs = helm.render(sets=("secrets.existingSecret=my-fairshare",))
    assert not of_kind(docs, "Secret")
    dep = one(docs, "Deployment", "gateway")
    assert {v["name"]: v for v in pod_spec(dep)["volumes"]}["secrets"]["secret"]["secretName"] == "my-fairshare"


# -- redis -----------------------------------------------------------------------------------------

def test_bundled_redis_url_points_at_the_redis_service(helm):
    docs = helm.render()
    svc = one(docs, "Service", "redis")
    url = env_of(container(one(docs, "Deployment", "gateway"), "gateway"))["FAIRSHARE_REDIS_URL"]["value"]
    m = re.fullmatch(r"redis://([^:/]+):(\d+)/0", url)
    assert m and m.group(1) == f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert int(m.group(2)) == svc["spec"]["ports"][0]["port"]
    assert selects(svc["spec"]["selector"], pod_labels(one(docs, "Deployment", "redis")))


@pytest.mark.parametrize("value_set", ["external-redis", "gpu+external-redis"])
def test_external_redis_url_comes_from_the_secret(helm, value_set):
    docs = helm.render(VALUE_SETS[value_set])
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"]
    ref = env_of(container(one(docs, "Deployment", "gateway"), "gateway"))["FAIRSHARE_REDIS_URL"]["valueFrom"]
    assert ref["secretKeyRef"] == {"name": one(docs, "Secret")["metadata"]["name"], "key": "redis-url"}


def test_external_redis_from_an_existing_secret(helm):
    docs = helm.render(sets=("redis.enabled=false", "redis.external.existingSecret.name=managed-redis"))
    ref = env_of(container(one(docs, "Deployment", "gateway"), "gateway"))["FAIRSHARE_REDIS_URL"]["valueFrom"]
    assert ref["secretKeyRef"] == {"name": "managed-redis", "key": "redis-url"}
    assert "redis-url" not in one(docs, "Secret")["data"]


# -- network policy and worker addressing ----------------------------------------------------------

@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_network_policy_lets_only_the_gateway_reach_workers(helm, value_set):
    docs = helm.render(VALUE_SETS[value_set])
    workers = pod_labels(one(docs, "StatefulSet", "worker"))
    gateways = pod_labels(one(docs, "Deployment", "gateway"))
    policies = [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"], workers)]
    assert len(policies) == 1
    np = policies[0]
    assert not selects(np["spec"]["podSelector"]["matchLabels"], gateways)
    assert np["spec"]["policyTypes"] == ["Ingress"]
    grpc_ports = {p["name"]: p["containerPort"] for p in container(one(docs, "StatefulSet", "worker"), "worker")["ports"]}
    assert np["spec"]["ingress"], "an empty ingress list would deny the gateway too"
    prometheus = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["metricsFrom"]
    rules = {tuple(p["port"] for p in rule["ports"]): rule for rule in np["spec"]["ingress"]}
    for ports, rule in rules.items():
        assert rule["from"], "a rule without `from` admits everyone"
        if ports == ("metrics",):  # Prometheus only, on the metrics port (reference workers serve it)
            assert "metrics" in grpc_ports and rule["from"] == prometheus
            continue
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "no namespaceSelector / ipBlock peers"
            assert selects(peer["podSelector"]["matchLabels"], gateways)
            assert not selects(peer["podSelector"]["matchLabels"], workers)
        assert ports == ("grpc",) and "grpc" in grpc_ports
    assert ("grpc",) in rules and (("metrics",) in rules) is ("metrics" in grpc_ports)
    # the gateway: the API port open, the admin listener (/metrics) to Prometheus only
    gp = [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"], gateways)]
    assert len(gp) == 1 and gp[0]["spec"]["policyTypes"] == ["Ingress"]
    by_port = {tuple(p["port"] for p in rule["ports"]): rule for rule in gp[0]["spec"]["ingress"]}
    assert set(by_port) == {("http",), ("metrics",)}
    assert "from" not in by_port[("http",)] and by_port[("metrics",)]["from"] == prometheus
    if "external-redis" not in value_set:
        redis = pod_labels(one(docs, "Deployment", "redis"))
        rp = [p for p in of_kind(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"], redis)]
        assert len(rp) == 1
        peers = [peer["podSelector"]["matchLabels"] for rule in rp[0]["spec"]["ingress"] for peer in rule["from"]]
        # the gateways, and the workers when they share pool-wide counters through Redis
        pool = "FAIRSHARE_POOL_REDIS_URL" in env_of(container(one(docs, "StatefulSet", "worker"), "worker"))
        assert all(selects(p, gateways) or (pool and selects(p, workers)) for p in peers)
        assert any(selects(p, gateways) for p in peers) and any(selects(p, workers) for p in peers) is pool


def test_network_policy_can_be_disabled(helm):
    assert not of_kind(helm.render(sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


@pytest.mark.parametrize("value_set,sets", [(k, ()) for k in VALUE_SETS] + [("default", ("worker.replicas=3",)),
                                                                             ("gpu", ("clusterDomain=k8s.example",))])
def test_gateway_worker_addresses_resolve_to_the_worker_service(helm, value_set, sets):
    docs = helm.render(VALUE_SETS[value_set], sets)
    sts = one(docs, "StatefulSet", "worker")
    svc = one(docs, "Service", "worker")
    gw = container(one(docs, "Deployment", "gateway"), "gateway")
    domain = dict(s.split("=", 1) for s in sets).get("clusterDomain", "cluster.local")
    # the StatefulSet's governing Service is the headless worker Service, which selects its pods
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert selects(svc["spec"]["selector"], pod_labels(sts))
    assert not selects(svc["spec"]["selector"], pod_labels(one(docs, "Deployment", "gateway")))
    container_ports = {p["name"]: p["containerPort"] for p in container(sts, "worker")["ports"]}
    svc_port = svc["spec"]["ports"][0]
    assert container_ports[svc_port["targetPort"]] == svc_port["port"]
    # FAIRSHARE_WORKERS: the headless Service's name (every pod's address, discovered live), not a
    # list rendered from worker.replicas: scaling the StatefulSet needs no upgrade
    entry = env_of(gw)["FAIRSHARE_WORKERS"]["value"]
    assert entry == f"dns:///{svc['metadata']['name']}.{NAMESPACE}.svc.{domain}:{svc_port['port']}"
    assert "," not in entry and f"{sts['metadata']['name']}-0" not in entry
    from gateway.discovery import parse_sources

    (source,) = parse_sources([entry])
    assert source.kind == "dns"
    # a different worker count renders the same gateway
    other = helm.render(VALUE_SETS[value_set], tuple(sets) + ("worker.replicas=7",))
    assert env_of(container(one(other, "Deployment", "gateway"), "gateway"))["FAIRSHARE_WORKERS"]["value"] == entry
    assert one(other, "StatefulSet", "worker")["spec"]["replicas"] == 7


def test_pool_counters_and_live_replica_count(helm):
    """Reference workers share pool-wide counters through the chart's Redis (worker.poolCounters,
    on by default); the gateway gets no replica count (replicas register in Redis)."""
    docs = helm.render()
    worker = container(one(docs, "StatefulSet", "worker"), "worker")
    gw = container(one(docs, "Deployment", "gateway"), "gateway")
    assert env_of(worker)["FAIRSHARE_POOL_REDIS_URL"] == env_of(gw)["FAIRSHARE_REDIS_URL"] | {
        "name": "FAIRSHARE_POOL_REDIS_URL"}
    assert "FAIRSHARE_GATEWAY_REPLICAS" not in env_of(gw)
    off = helm.render(sets=("worker.poolCounters=false",))
    assert "FAIRSHARE_POOL_REDIS_URL" not in env_of(container(one(off, "StatefulSet", "worker"), "worker"))
    ext = helm.render(VALUE_SETS["external-redis"])
    w_env = env_of(container(one(ext, "StatefulSet", "worker"), "worker"))["FAIRSHARE_POOL_REDIS_URL"]
    assert w_env["valueFrom"] == env_of(container(one(ext, "Deployment", "gateway"), "gateway"))[
        "FAIRSHARE_REDIS_URL"]["valueFrom"]


# -- gateway scaling, disruption, monitoring, security ---------------------------------------------

def test_gateway_hpa_and_pdbs_target_the_right_pods(helm):
    docs = helm.render()
    dep = one(docs, "Deployment", "gateway")
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": dep["metadata"]["name"]}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert container(dep, "gateway")["resources"]["requests"]["cpu"], "CPU utilisation needs a CPU request"
    assert selects(one(docs, "PodDisruptionBudget", "gateway")["spec"]["selector"]["matchLabels"], pod_labels(dep))
    assert selects(one(docs, "PodDisruptionBudget", "worker")["spec"]["selector"]["matchLabels"],
                   pod_labels(one(docs, "StatefulSet", "worker")))
    fixed = helm.render(sets=("gateway.autoscaling.enabled=false", "gateway.replicas=3"))
    assert not of_kind(fixed, "HorizontalPodAutoscaler")
    assert one(fixed, "Deployment", "gateway")["spec"]["replicas"] == 3


def _port_chain(docs, sm, workload):
    """The ServiceMonitor `sm` -> the one Service it selects -> the container port it reaches on
    `workload`'s pods. Returns (service, container, containerPort number)."""
    sel = sm["spec"]["selector"]["matchLabels"]
    services = [s for s in of_kind(docs, "Service") if selects(sel, s["metadata"]["labels"])]
    assert len(services) == 1, [s["metadata"]["name"] for s in services]
    svc = services[0]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    svc_port = {p["name"]: p for p in svc["spec"]["ports"]}[endpoint["port"]]
    assert selects(svc["spec"]["selector"], pod_labels(workload))
    c = pod_spec(workload)["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    return svc, c, ports[svc_port["targetPort"]]


def test_service_monitor_is_optional_and_scrapes_the_metrics_ports(helm):
    assert not of_kind(helm.render(), "ServiceMonitor")
    docs = helm.render(sets=("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prom"))
    sms = {sm["metadata"]["labels"]["app.kubernetes.io/component"]: sm for sm in of_kind(docs, "ServiceMonitor")}
    assert set(sms) == {"gateway", "worker"}
    for sm in sms.values():
        assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"]["release"] == "prom"
        assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    # gateway: the admin listener (the public port answers /metrics with 403)
    dep = one(docs, "Deployment", "gateway")
    svc, gw, port = _port_chain(docs, sms["gateway"], dep)
    env = env_of(gw)
    assert int(env["FAIRSHARE_METRICS_PORT"]["value"]) == port == 9100
    assert env["FAIRSHARE_METRICS_HOST"]["value"] == "0.0.0.0"
    assert port != {p["name"]: p["containerPort"] for p in gw["ports"]}["http"]
    assert svc["spec"]["type"] == "ClusterIP", "metrics never on the public (maybe LoadBalancer) Service"
    public = [s for s in of_kind(docs, "Service") if s["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
              and s is not svc]
    assert len(public) == 1 and "metrics" not in {p["name"] for p in public[0]["spec"]["ports"]}
    # worker: --metrics-port
    sts = one(docs, "StatefulSet", "worker")
    _, worker, port = _port_chain(docs, sms["worker"], sts)
    assert int(worker["args"][worker["args"].index("--metrics-port") + 1]) == port == 9101
    # other ports are values
    docs = helm.render(sets=("serviceMonitor.enabled=true", "gateway.metrics.port=9300", "worker.metrics.port=9301"))
    sms = {sm["metadata"]["labels"]["app.kubernetes.io/component"]: sm for sm in of_kind(docs, "ServiceMonitor")}
    _, gw, port = _port_chain(docs, sms["gateway"], one(docs, "Deployment", "gateway"))
    assert port == 9300 and env_of(gw)["FAIRSHARE_METRICS_PORT"]["value"] == "9300"
    _, worker, port = _port_chain(docs, sms["worker"], one(docs, "StatefulSet", "worker"))
    assert port == 9301 and worker["args"][worker["args"].index("--metrics-port") + 1] == "9301"


@pytest.mark.parametrize("value_set", GPU_SETS)
def test_sglang_workers_get_the_flags_the_sglang_worker_accepts(helm, value_set):
    """The SGLang worker takes the reference worker's --metrics-port, --kv-* and --tier-* flags (its
    plugin's core applies them), never --iteration-token-target (SGLang decodes every running
    request each step); the chart passes exactly what `fairshare worker --engine sglang` parses."""
    from worker.sglang_server import build_parser, plugin_settings
    from worker.sglang_plugin import state_from_env

    docs = helm.render(VALUE_SETS[value_set], ("serviceMonitor.enabled=true", "worker.kvQuota.enabled=true",
                                               "worker.kvQuota.softQuotas.batch=0.2", "worker.iterationTokenTarget=32"))
    worker = container(one(docs, "StatefulSet", "worker"), "worker")
    assert "--iteration-token-target" not in worker["args"]
    assert "metrics" in {p["name"] for p in worker["ports"]}
    assert sorted(sm["metadata"]["labels"]["app.kubernetes.io/component"] for sm in of_kind(docs, "ServiceMonitor")) \
        == ["gateway", "worker"]
    parser = build_parser()
    args = parser.parse_args(worker["args"])   # exits on anything the SGLang worker refuses
    state = state_from_env(plugin_settings(parser, args))
    assert state.kv_quota.soft == {"batch": 0.2} and state.tier_min_shares == {"batch": 0.05, "background": 0.05}


def test_kv_quota_values_become_worker_flags_the_worker_accepts(helm, tmp_path):
    from worker.cli import build_parser, kv_quota_settings
    from worker.scheduling.quota import KVQuotaConfig

    worker = container(one(helm.render(), "StatefulSet", "worker"), "worker")
    assert not [a for a in worker["args"] if a.startswith("--kv-")], "KV quotas are off by default"
    f = tmp_path / "quota.yaml"
    f.write_text(yaml.safe_dump({"worker": {"kvQuota": {
        "enabled": True, "watermark": 0.9, "headroom": 0.1, "sharedBuffer": 0.05, "hardCap": 0.75,
        "softQuotas": {"acme": 0.3, "batch": 0.1}, "hardCaps": {"globex": 0.5}}}}))
    args = container(one(helm.render((str(f),)), "StatefulSet", "worker"), "worker")["args"]
    parser = build_parser()
    settings = kv_quota_settings(parser, parser.parse_args(args))  # exits on anything the worker refuses
    assert settings == KVQuotaConfig(enabled=True, watermark=0.9, headroom=0.1, shared_buffer=0.05, hard_cap=0.75,
                                     soft={"acme": 0.3, "batch": 0.1}, hard={"globex": 0.5})
    # as `--set` passes them (strings)
    args = container(one(helm.render(sets=("worker.kvQuota.enabled=true", "worker.kvQuota.watermark=0.7",
                                           "worker.kvQuota.softQuotas.batch=0.2")), "StatefulSet", "worker"), "worker")["args"]
    settings = kv_quota_settings(parser, parser.parse_args(args))
    assert settings.watermark == 0.7 and settings.soft == {"batch": 0.2}


def test_tier_values_become_worker_flags_the_worker_accepts(helm, tmp_path):
    from worker.cli import build_parser, tier_settings

    parser = build_parser()
    args = container(one(helm.render(), "StatefulSet", "worker"), "worker")["args"]
    assert tier_settings(parser, parser.parse_args(args)) == {  # the defaults, spelled out
        "tier_scheduling": True, "tier_min_shares": {"batch": 0.05, "background": 0.05}, "iteration_token_target": None,
        "lower_tier_token_target": 1, "tier_grace_iterations": 1024, "lower_tier_idle_token_target": 16}
    f = tmp_path / "tiers.yaml"
    f.write_text(yaml.safe_dump({"worker": {"tiers": {"minShares": {"batch": 0.1, "background": 0.02}},
                                            "iterationTokenTarget": 32, "lowerTierTokenTarget": 0,
                                            "lowerTierGraceIterations": 0, "lowerTierIdleTokenTarget": 48}}))
    args = container(one(helm.render((str(f),)), "StatefulSet", "worker"), "worker")["args"]
    assert tier_settings(parser, parser.parse_args(args)) == {
        "tier_scheduling": True, "tier_min_shares": {"batch": 0.1, "background": 0.02}, "iteration_token_target": 32,
        "lower_tier_token_target": None, "tier_grace_iterations": 0, "lower_tier_idle_token_target": 48}
    args = container(one(helm.render(sets=("worker.tiers.enabled=false", "worker.iterationTokenTarget=0")),
                         "StatefulSet", "worker"), "worker")["args"]
    assert "--no-tier-scheduling" in args and "--iteration-token-target" not in args
    assert tier_settings(parser, parser.parse_args(args))["tier_scheduling"] is False
    res = helm.template(sets=("worker.tiers.minShares.background=1.5",))
    assert res.returncode != 0 and "minShares" in res.stderr


def test_weight_format_values_become_worker_flags_the_worker_accepts(helm):
    """worker.dtype / worker.quantization / worker.threads reach the reference worker as --dtype /
    --quantization / --threads, parsed by the worker's own parser and format check."""
    from worker.cli import build_parser, format_settings

    parser = build_parser()
    args = container(one(helm.render(), "StatefulSet", "worker"), "worker")["args"]
    parsed = parser.parse_args(args)
    format_settings(parser, parsed)  # exits on a combination the worker refuses
    assert (parsed.dtype, parsed.quantization, parsed.threads) == ("auto", "auto", None)  # the defaults
    args = container(one(helm.render(sets=("worker.dtype=bfloat16", "worker.quantization=int8", "worker.threads=2")),
                         "StatefulSet", "worker"), "worker")["args"]
    parsed = parser.parse_args(args)
    format_settings(parser, parsed)
    assert (parsed.dtype, parsed.quantization, parsed.threads) == ("bfloat16", "int8", 2)
    res = helm.template(sets=("worker.quantization=int3",))
    assert res.returncode != 0 and "quantization" in res.stderr


def test_thread_wait_value_sets_the_openmp_wait_policy_of_reference_workers(helm):
    """worker.threadWait reaches the reference worker as OMP_WAIT_POLICY (passive by default, as the
    worker's own default; spin: ACTIVE), which the worker keeps (worker.cli.passive_thread_wait
    defers to a policy already set); an unknown value is refused by the schema."""
    def policy(*sets):
        env = container(one(helm.render(sets=sets), "StatefulSet", "worker"), "worker")["env"]
        return [e["value"] for e in env if e["name"] == "OMP_WAIT_POLICY"]

    assert policy() == ["PASSIVE"]
    assert policy("worker.threadWait=spin") == ["ACTIVE"]
    res = helm.template(sets=("worker.threadWait=busy",))
    assert res.returncode != 0 and "threadWait" in res.stderr


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_run_as_non_root(helm, value_set):
    for w in (d for d in helm.render(VALUE_SETS[value_set]) if d["kind"] in WORKLOAD_KINDS):
        sc = pod_spec(w)["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, w["metadata"]["name"]
        for c in pod_spec(w)["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_images_follow_the_registry_value(helm):
    docs = helm.render(sets=("image.registry=ghcr.io/acme/", "gateway.image.tag=1.2.3"))
    assert container(one(docs, "Deployment", "gateway"), "gateway")["image"] == "ghcr.io/acme/fairshare/gateway:1.2.3"
    assert container(one(docs, "StatefulSet", "worker"), "worker")["image"] == "ghcr.io/acme/fairshare/worker-cpu:0.1.0"


# -- the documented key flow, end to end through the chart ------------------------------------------

def test_keys_created_with_the_cli_authenticate_through_the_rendered_chart(helm, tmp_path):
    """docs/deploy.md: `fairshare keys create` locally, then `helm install -f tenants.yaml
    --set-file secrets.serverSecret=... --set-file secrets.keysFile=...`; the gateway, reading the
    files the pod would mount, accepts the key and maps it to its tenant."""
    tenants = tmp_path / "tenants.yaml"
    shutil.copy(DEPLOY / "config" / "tenants.yaml", tenants)
    secret_file, keys_file = tmp_path / "server-secret", tmp_path / "tenants.keys.yaml"
    res = subprocess.run([sys.executable, "-m", "fairshare.cli", "keys", "create", "--tenant", "globex",
                          "--tenants", str(tenants), "--secret-file", str(secret_file), "--keys-file", str(keys_file)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    key = res.stdout.strip()
    assert key.startswith("sk-fs-")

    args = helm.template_args((str(tenants),)) + ["--set-file", f"secrets.serverSecret={secret_file}",
                                                   "--set-file", f"secrets.keysFile={keys_file}"]
    out = helm.run(*args)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert key not in out.stdout, "the API key itself must never reach the manifests"

    # lay the mounted files out as the gateway pod sees them
    dep = one(docs, "Deployment", "gateway")
    env = env_of(container(dep, "gateway"))
    pod = tmp_path / "pod"
    cm = one(docs, "ConfigMap")
    secret = one(docs, "Secret")
    files = {env["FAIRSHARE_TENANTS_FILE"]["value"]: cm["data"]["tenants.yaml"].encode()}
    for var, k in (("FAIRSHARE_SECRET_FILE", "server-secret"), ("FAIRSHARE_KEYS_FILE", "tenants.keys.yaml")):
        files[env[var]["value"]] = base64.b64decode(secret["data"][k])
    for path, data in files.items():
        (pod / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (pod / path.lstrip("/")).write_bytes(data)
    server_secret = (pod / env["FAIRSHARE_SECRET_FILE"]["value"].lstrip("/")).read_text().strip().encode()
    directory = TenantDirectory(server_secret, pod / env["FAIRSHARE_TENANTS_FILE"]["value"].lstrip("/"),
                                pod / env["FAIRSHARE_KEYS_FILE"]["value"].lstrip("/"))
    principal = directory.authenticate(f"Bearer {key}")
    assert principal.tenant.id == "globex" and principal.tenant.weight == 3.0
    assert sorted(directory.tenants()) == ["acme", "globex", "nightly"]
    with pytest.raises(Exception):
        directory.authenticate("Bearer sk-fs-not-a-key")


def test_hand_back_value_becomes_the_worker_flag_the_worker_accepts(helm):
    """worker.handBackAfterS reaches the reference worker as --hand-back-after-s (default 0.5; 0: off),
    parsed by the worker's own parser; a negative value is refused by the schema."""
    from worker.cli import build_parser

    parser = build_parser()
    args = container(one(helm.render(), "StatefulSet", "worker"), "worker")["args"]
    assert parser.parse_args(args).hand_back_after_s == 0.5
    args = container(one(helm.render(sets=("worker.handBackAfterS=0",)), "StatefulSet", "worker"), "worker")["args"]
    assert parser.parse_args(args).hand_back_after_s == 0.0
    res = helm.template(sets=("worker.handBackAfterS=-1",))
    assert res.returncode != 0 and "handBackAfterS" in res.stderr
