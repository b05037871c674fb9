"""FairShare's SGLang plugin: SGLang's own scheduler runs weighted VTC, KV quotas and per-tenant
radix-cache namespaces, with the same `worker.scheduling` policy objects as the reference engine.

Registered in pyproject.toml under SGLang's general-plugin entry-point group:

    [project.entry-points."sglang.srt.plugins"]
    fairshare = "worker.sglang_plugin:register"

SGLang 0.5.23 calls `sglang.srt.plugins.load_plugins()` early in every process it starts (engine,
each scheduler — spawned, one per tensor-parallel rank —, detokenizer); it runs each plugin's
function, then `HookRegistry.apply_hooks()`. `register()` adds the hooks of
`worker.sglang_plugin.hooks.HOOKS` only in processes that import SGLang's scheduler (the engine
process and the schedulers; not the detokenizer), and builds this process's `FairShareState`.
`SGLANG_PLUGINS=<names>` (SGLang's whitelist) or `FAIRSHARE_SGLANG_POLICY=off` turns it off.

Configuration (environment, inherited by SGLang's spawned processes):

- `FAIRSHARE_SGLANG_POLICY`: `vtc` (default), `vtc-pred`, `drr`, `fcfs` (accounting only, SGLang's
  order kept) or `off` (no hooks at all).
- `FAIRSHARE_SGLANG_ALPHA` / `_BETA` / `_CACHED_RATE`: the linear cost `α·P + β·O` (defaults 1, 2,
  0; DESIGN.md "Service unit").
- `FAIRSHARE_SGLANG_KV_QUOTA`: JSON of the reference worker's KV quota settings
  (`worker.scheduling.quota.KVQuotaConfig` fields: `enabled`, `watermark`, `headroom`,
  `shared_buffer`, `hard_cap`, `soft`, `hard`; fractions of SGLang's KV pool); unset: off.
  `fairshare worker --engine sglang --kv-quota ...` sets it from the same `--kv-*` flags.
- `FAIRSHARE_SGLANG_TIERS`: JSON `{"scheduling": true, "min_shares": {"batch": 0.05, ...}}`, the
  `--tier-scheduling` / `--tier-min-share` flags (default: on, 5 % per lower tier).
- `FAIRSHARE_SGLANG_SECRET`: the HMAC secret of tenant tokens (`worker.sglang_plugin.tenant`);
  `fairshare worker --engine sglang` creates it before starting SGLang.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.scheduling.quota import KVQuotaConfig

log = logging.getLogger("fairshare.sglang_plugin")

POLICY_ENV = "FAIRSHARE_SGLANG_POLICY"
QUOTA_ENV = "FAIRSHARE_SGLANG_KV_QUOTA"
TIERS_ENV = "FAIRSHARE_SGLANG_TIERS"
_registered = False


def state_from_env(environ=None):
    """Build a `FairShareState` from the environment (see the module docstring). Raises ValueError
    on a bad setting."""
    from worker.scheduling.cost import LinearCost
    from worker.scheduling.quota import KVQuotaConfig
    from worker.sglang_plugin.state import FairShareState
    from worker.sglang_plugin.tenant import SECRET_ENV

    env = os.environ if environ is None else environ
    policy = env.get(POLICY_ENV, "vtc") or "vtc"
    cost = LinearCost(float(env.get("FAIRSHARE_SGLANG_ALPHA", 1.0)), float(env.get("FAIRSHARE_SGLANG_BETA", 2.0)),
                      float(env.get("FAIRSHARE_SGLANG_CACHED_RATE", 0.0)))
    if env.get("FAIRSHARE_SGLANG_KV_QUOTAS"):
        raise ValueError("FAIRSHARE_SGLANG_KV_QUOTAS (soft quotas in tokens) is gone: set FAIRSHARE_SGLANG_KV_QUOTA "
                         "(the worker's --kv-* settings) instead")
    quota = None
    raw = env.get(QUOTA_ENV)
    if raw:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise ValueError(f"{QUOTA_ENV} must be a JSON object of KVQuotaConfig fields")
        try:
            quota = KVQuotaConfig(**fields)
        except TypeError as exc:
            raise ValueError(f"{QUOTA_ENV}: {exc}") from None
    tiers = json.loads(env.get(TIERS_ENV) or "{}")
    if not isinstance(tiers, dict) or set(tiers) - {"scheduling", "min_shares"}:
        raise ValueError(f'{TIERS_ENV} must be a JSON object {{"scheduling": bool, "min_shares": {{tier: frac}}}}')
    return FairShareState(policy, cost, secret=env.get(SECRET_ENV) or None, kv_quota=quota,
                          tier_min_shares=tiers.get("min_shares") or {}, tier_scheduling=bool(tiers.get("scheduling", True)))


def plugin_env(kv_quota: KVQuotaConfig | None = None, tiers: dict | None = None) -> dict[str, str]:
    """The environment `state_from_env` reads for the worker's KV quota and tier settings (as
    `worker.cli.kv_quota_settings` / `tier_settings` return them: a `KVQuotaConfig`, whose fields
    become the JSON object of `QUOTA_ENV` when it is enabled)."""
    out = {}
    if kv_quota is not None and kv_quota.enabled:
        out[QUOTA_ENV] = json.dumps(dataclasses.asdict(kv_quota), sort_keys=True)
    if tiers is not None:
        out[TIERS_ENV] = json.dumps({"scheduling": bool(tiers["tier_scheduling"]),
                                     "min_shares": tiers["tier_min_shares"]}, sort_keys=True)
    return out


def register(force: bool = False) -> bool:
    """The `sglang.srt.plugins` entry point. Returns whether hooks were registered.

    force: register even in a process that has not imported SGLang's scheduler (tests).
    """
    global _registered
    if _registered:
        return True
    if os.environ.get(POLICY_ENV, "").lower() == "off":
        log.info("fairshare SGLang plugin disabled (%s=off)", POLICY_ENV)
        return False
    if not force and "sglang.srt.managers.scheduler" not in sys.modules:
        return False  # e.g. the detokenizer process: no scheduler to hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from worker.sglang_plugin import hooks

    try:
        state = state_from_env()
    except ValueError as exc:
        # SGLang's load_plugins() logs and ignores a plugin's exceptions, which would silently
        # serve without fairness: stop the process instead (the engine then fails to start).
        raise SystemExit(f"fairshare SGLang plugin: bad configuration: {exc}") from exc
    hooks.set_state(state)
    for h in hooks.HOOKS:
        HookRegistry.register(h.target, h.fn, HookType[h.hook_type])
    _registered = True
    log.info("fairshare SGLang plugin: %s, %d hooks", hooks.get_state().policy.describe(), len(hooks.HOOKS))
    return True
