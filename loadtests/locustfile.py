"""Locust users for a FairShare campaign: one user class per tenant, streaming chat completions.

Run by `fairshare loadtest` (which writes the config and reads the results), or by hand::

    FAIRSHARE_LOADTEST_CAMPAIGN=noisy-neighbour FAIRSHARE_LOADTEST_KEYS=keys.yaml \\
      locust -f loadtests/locustfile.py --headless --host https://llm.example.com \\
             -u 32 -r 32 -t 60s --csv out/locust

Configuration: ``FAIRSHARE_LOADTEST_CONFIG`` names a JSON file with ``campaign``, ``duration_s``,
``seed``, ``rate_scale``, ``length_scale``, ``host``, ``model``, ``keys`` ({tenant: key}) and
``records`` (where to write the per-request records). Without it, ``FAIRSHARE_LOADTEST_CAMPAIGN``
(default noisy-neighbour), ``FAIRSHARE_LOADTEST_DURATION``, ``FAIRSHARE_LOADTEST_SEED``,
``FAIRSHARE_LOADTEST_RATE_SCALE``, ``FAIRSHARE_LOADTEST_LENGTH_SCALE``,
``FAIRSHARE_LOADTEST_MODEL``, ``FAIRSHARE_LOADTEST_RECORDS`` and the keys from the environment
(`loadtests.client.keys_from_env`) are used, and the host comes from ``--host``.

Each tenant's class has ``fixed_count`` = the campaign's users for it (so ``-u`` should be their sum)
and replays the tenant's requests from the shared workload open-loop (see `loadtests.campaigns`).

Per tenant, through Locust's ``request`` event (request_type / name):

- ``chat`` / tenant: the whole request (response time = end of stream); 429s and errors as failures;
- ``TTFT`` / tenant: time to the first content chunk;
- ``ITL`` / tenant: each gap between content chunks.

At ``quitting`` every request (including those cut by the end of the run) is written as JSON to
``records``, with the wall-clock start of the run, for `loadtests.reports.loadtest`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import gevent
import httpx
from locust import User, constant, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `locust -f` from anywhere in a checkout

from loadtests.campaigns import get_campaign  # noqa: E402
from loadtests.client import RequestRecord, chat_body, keys_from_env, stream_chat, synth_prompt  # noqa: E402


def _config() -> dict:
    path = os.environ.get("FAIRSHARE_LOADTEST_CONFIG")
    if path:
        return json.loads(Path(path).read_text())
    cfg = {
        "campaign": os.environ.get("FAIRSHARE_LOADTEST_CAMPAIGN", "noisy-neighbour"),
        "duration_s": float(os.environ.get("FAIRSHARE_LOADTEST_DURATION") or 0) or None,
        "seed": int(os.environ.get("FAIRSHARE_LOADTEST_SEED", "0")),
        "rate_scale": float(os.environ.get("FAIRSHARE_LOADTEST_RATE_SCALE", "1")),
        "length_scale": float(os.environ.get("FAIRSHARE_LOADTEST_LENGTH_SCALE", "1")),
        "model": os.environ.get("FAIRSHARE_LOADTEST_MODEL") or None,
        "records": os.environ.get("FAIRSHARE_LOADTEST_RECORDS") or None,
        "host": None,
    }
    cfg["keys"] = keys_from_env(get_campaign(cfg["campaign"]).tenant_ids())
    return cfg


CONFIG = _config()
CAMPAIGN = get_campaign(CONFIG["campaign"])
WORKLOAD = CAMPAIGN.workload(CONFIG.get("duration_s"))
SCHEDULES: dict[str, collections.deque] = {t: collections.deque() for t in CAMPAIGN.tenant_ids()}
for _spec in CAMPAIGN.requests(CONFIG.get("duration_s"), seed=int(CONFIG.get("seed") or 0),
                               rate_scale=float(CONFIG.get("rate_scale") or 1.0),
                               length_scale=float(CONFIG.get("length_scale") or 1.0)):
    SCHEDULES[_spec.tenant_id].append(_spec)
PLANNED = {t: len(q) for t, q in SCHEDULES.items()}
RECORDS: list[RequestRecord] = []
STATE = {"t0": None, "t0_wall": None, "model": CONFIG.get("model")}


def _start_clock() -> None:
    if STATE["t0"] is None:
        STATE["t0"] = time.monotonic()
        STATE["t0_wall"] = time.time()


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    missing = [t for t in CAMPAIGN.tenant_ids() if not CONFIG["keys"].get(t)]
    if missing:
        raise SystemExit(f"no API key for tenant(s) {', '.join(missing)} (see loadtests/client.py: keys)")
    if not STATE["model"]:
        host = (CONFIG.get("host") or environment.host or "").rstrip("/")
        key = CONFIG["keys"][CAMPAIGN.tenant_ids()[0]]
        r = httpx.get(host + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r.raise_for_status()
        STATE["model"] = r.json()["data"][0]["id"]
    _start_clock()


@events.quitting.add_listener
def _on_quitting(environment, **_kw) -> None:
    path = CONFIG.get("records")
    if not path:
        return
    out = {
        "campaign": CAMPAIGN.name,
        "workload": WORKLOAD.description,
        "duration_s": WORKLOAD.duration_s,
        "seed": CONFIG.get("seed"),
        "rate_scale": CONFIG.get("rate_scale"),
        "length_scale": CONFIG.get("length_scale", 1.0),
        "model": STATE["model"],
        "t0_wall": STATE["t0_wall"],
        "t_end": time.monotonic() - STATE["t0"] if STATE["t0"] is not None else None,
        "planned": PLANNED,
        "unsent": {t: len(q) for t, q in SCHEDULES.items()},
        "weights": WORKLOAD.weights(),
        "users": {t: s.users for t, s in CAMPAIGN.tenants.items()},
        "records": [r.to_json() for r in RECORDS],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out))


def _fire(environment, request_type: str, name: str, ms: float, length: int = 0, exc: Exception | None = None):
    environment.events.request.fire(request_type=request_type, name=name, response_time=ms,
                                    response_length=length, exception=exc, context={})


class TenantUser(User):
    """Sends one tenant's scheduled requests; subclasses (one per tenant) set `tenant_id`."""

    abstract = True
    wait_time = constant(0)
    tenant_id = ""

    def on_start(self) -> None:
        _start_clock()
        base = (CONFIG.get("host") or self.environment.host or self.host or "").rstrip("/")
        self.url = base + "/v1/chat/completions"
        self.key = CONFIG["keys"][self.tenant_id]
        self.http = httpx.Client(timeout=httpx.Timeout(600.0, connect=15.0),
                                 limits=httpx.Limits(max_connections=2, max_keepalive_connections=1))

    def on_stop(self) -> None:
        self.http.close()

    @task
    def send_next(self) -> None:
        queue = SCHEDULES[self.tenant_id]
        if not queue:
            gevent.sleep(0.5)
            return
        spec = queue.popleft()
        delay = STATE["t0"] + spec.arrival_s - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        t_send = time.monotonic() - STATE["t0"]
        rec = RequestRecord(tenant=self.tenant_id, request_id=spec.request_id, t_sched=spec.arrival_s,
                            t_send=t_send, prompt_tokens_planned=spec.prompt_tokens,
                            max_tokens=spec.output_tokens, late_s=max(0.0, t_send - spec.arrival_s))
        RECORDS.append(rec)  # a request cut by the end of the run stays here as outcome "cut"
        body = chat_body(STATE["model"], synth_prompt(spec.request_id, spec.prompt_tokens), spec.output_tokens)
        stream_chat(self.http, self.url, self.key, body, rec)
        env = self.environment
        exc = None if rec.outcome == "ok" else Exception(f"{rec.status} {rec.error}"[:200])
        _fire(env, "chat", self.tenant_id, (rec.e2e_s or 0.0) * 1000, rec.completion_tokens or 0, exc)
        if rec.ttft_s is not None:
            _fire(env, "TTFT", self.tenant_id, rec.ttft_s * 1000)
        for gap in rec.itl_s:
            _fire(env, "ITL", self.tenant_id, gap * 1000)
        if rec.outcome == "rejected":  # honour retry-after (capped) instead of hammering the gateway
            gevent.sleep(min(rec.retry_after_s if rec.retry_after_s else 0.25, 1.0))
        elif rec.outcome == "error":
            gevent.sleep(0.5)


def _user_class(tenant_id: str, users: int) -> type:
    name = "Tenant_" + "".join(c if c.isalnum() else "_" for c in tenant_id)
    return type(name, (TenantUser,), {"tenant_id": tenant_id, "fixed_count": users, "weight": 1,
                                      "__module__": __name__})


for _tid, _setup in CAMPAIGN.tenants.items():
    _cls = _user_class(_tid, _setup.users)
    globals()[_cls.__name__] = _cls
del _tid, _setup, _cls  # Locust collects the User classes it finds in this module's globals
