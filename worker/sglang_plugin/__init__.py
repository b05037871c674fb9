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
- `FAIRSHARE_SGLANG_KV_QUOTAS`: JSON `{"tenant": tokens}`, soft KV quotas used by the retraction
  order (default: each tenant's weighted share of what the decode batch holds).
- `FAIRSHARE_SGLANG_SECRET`: the HMAC secret of tenant tokens (`worker.sglang_plugin.tenant`);
  `fairshare worker --engine sglang` creates it before starting SGLang.
"""

from __future__ import annotations

import json
import logging
import os
import sys

log = logging.getLogger("fairshare.sglang_plugin")

POLICY_ENV = "FAIRSHARE_SGLANG_POLICY"
_registered = False


def state_from_env(environ=None, retraction_base=None):
    """Build a `FairShareState` from the environment (see the module docstring). Raises ValueError
    on a bad setting."""
    from worker.scheduling.cost import LinearCost
    from worker.sglang_plugin.state import FairShareState
    from worker.sglang_plugin.tenant import SECRET_ENV

    env = os.environ if environ is None else environ
    policy = env.get(POLICY_ENV, "vtc") or "vtc"
    cost = LinearCost(float(env.get("FAIRSHARE_SGLANG_ALPHA", 1.0)), float(env.get("FAIRSHARE_SGLANG_BETA", 2.0)),
                      float(env.get("FAIRSHARE_SGLANG_CACHED_RATE", 0.0)))
    quotas = json.loads(env.get("FAIRSHARE_SGLANG_KV_QUOTAS") or "{}")
    if not isinstance(quotas, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in quotas.values()):
        raise ValueError("FAIRSHARE_SGLANG_KV_QUOTAS must be a JSON object of positive token counts")
    return FairShareState(policy, cost, secret=env.get(SECRET_ENV) or None, kv_quotas=quotas,
                          retraction_base=retraction_base)


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
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from worker.sglang_plugin import hooks

    # SGLang's own order, captured before the REPLACE hook is applied; used within each tenant.
    original = ScheduleBatch.__dict__["_get_decode_retraction_order"]
    original = getattr(original, "__func__", original)
    try:
        state = state_from_env(retraction_base=original)
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
