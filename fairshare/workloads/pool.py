"""Pool workloads: traffic whose tenants prefix routing concentrates on a few workers.

- pool-skew (`SKEWED_OVERLOAD`): 4 workers, 6 tenants, everyone overloaded. Each tenant repeats one
  128-token system prompt (then a private 128-token user turn, 256 output tokens); the tenant ids
  are picked so that the ``prefix`` routing policy's rendezvous hash (namespace + the first 32 prompt
  tokens, over workers w0..w3: the simulator's ids) homes three of them on w0 and one on each of w1,
  w2 and w3. Rates make every worker's arrivals equal (the w0 tenants send a third of what the others
  send: 2 against 6 req/s, three times a worker's capacity), so the load bound sees no imbalance and
  keeps the affinity: per-worker VTC then gives each w0 tenant a third of a worker and each other
  tenant a whole one, while the pool-wide fair share is 4/6 of a worker each. The reference is one
  worker with the pool's capacity running VTC over all six.
"""

from __future__ import annotations

from fairshare.workloads import TenantLoad, Workload
from fairshare.workloads.shared_prefix import SharedPrefixWorkload

SRC = "FairShare issue #18 (a pool, not a worker)"
POOL_WORKERS = 4
ROUTE_PREFIX_TOKENS = 32  # the prefix routing default (gateway.routing_policy.PrefixAffinity)

# Each tenant's first-choice worker under the prefix policy's rendezvous hash (route key: namespace
# ``tenant + "\x00"`` and the first ROUTE_PREFIX_TOKENS tokens of its system prompt, over w0..w3),
# in the order of the lowest tenant numbers homed there. Written down rather than computed: this
# shared layer does not import the gateway; tests/unit/test_fairness_sim_pool.py recomputes them with
# `gateway.routing_policy` and fails when the hash would home them elsewhere.
HOMES = {"w0": ("tenant2", "tenant3", "tenant8"), "w1": ("tenant1",), "w2": ("tenant7",), "w3": ("tenant4",)}


def probe_workload() -> SharedPrefixWorkload:
    """The prompts the homes are computed from: one 128-token system prompt per tenant, seed 0."""
    return SharedPrefixWorkload(Workload("probe", "", ()), public_tokens=0, system_prompts=1, system_tokens=128,
                                prompt_seed=0)


def skewed_overload(crowded: int = 3, low_rate: float = 2.0, duration_s: float = 120.0) -> SharedPrefixWorkload:
    """`crowded` (at most 3) tenants homed on w0 at `low_rate` req/s each, one tenant homed on each
    other worker at ``crowded * low_rate`` req/s (rates for the reference server of 2 req/s; module
    docstring). Raises ValueError for more crowded tenants than `HOMES` lists."""
    if not 1 <= crowded <= len(HOMES["w0"]):
        raise ValueError(f"crowded must be 1..{len(HOMES['w0'])}, got {crowded}")
    workers = POOL_WORKERS
    chosen = list(HOMES["w0"][:crowded]) + [HOMES[f"w{i}"][0] for i in range(1, workers)]
    tenants = tuple(TenantLoad(t, low_rate if k < crowded else crowded * low_rate, 128, 256)
                    for k, t in enumerate(chosen))
    base = Workload("pool-skew", f"{workers} workers: {crowded} tenants homed on one worker at {low_rate:g} req/s each, "
                    f"one tenant on each other worker at {crowded * low_rate:g} req/s (128-token system prompt + "
                    f"128-token user turn, 256 out); every worker at {crowded * low_rate / 2:g}x capacity",
                    tenants, duration_s=duration_s, source=SRC)
    return SharedPrefixWorkload(base, public_tokens=0, system_prompts=1, system_tokens=128, prompt_seed=0)


SKEWED_OVERLOAD = skewed_overload()

WORKLOADS = {w.name: w for w in (SKEWED_OVERLOAD,)}
