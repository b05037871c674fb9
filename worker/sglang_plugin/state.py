"""Scheduler-side FairShare state for one SGLang scheduler process.

Imports neither sglang nor torch. It works on SGLang 0.5.23 `Req` objects by duck typing, reading
only these fields: `rid`, `origin_input_ids`, `output_ids`, `prefix_len`, `extend_end`,
`is_retracted`, `finished()`, `extra_key`, `cache_salt`, `lora_id`, `sampling_params` (`custom_params`,
`max_new_tokens`) — and it writes `extra_key` (namespace enforcement) and one attribute of its own,
`fairshare_tag`.

The policy objects are those of the reference engine (`worker.scheduling`): `make_policy`,
`SchedulingPolicy.on_arrival / on_admit / charge / on_request_finish / on_idle / order`, the
tenant accounts, and the cost function's `prefill` / `decode`.

Determinism: each tensor-parallel rank runs its own scheduler on the same inputs, so every
decision here is a function of the requests and of the order of hook calls only: no clocks, no
randomness, no iteration over sets of strings (whose order depends on the per-process hash seed);
ties break by tenant id and by queue position.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from worker.scheduling.cost import CostFunction, LinearCost
from worker.scheduling.policy import SchedulingPolicy, make_policy
from worker.sglang_plugin import tenant as tenant_mod
from worker.sglang_plugin.tenant import TenantTag

log = logging.getLogger("fairshare.sglang_plugin")

TAG_ATTR = "fairshare_tag"


@dataclass
class TrackedRequest:
    """One live request as the plugin accounts it.

    prompt_len: prompt tokens. arrival: arrival sequence number in this process. prompt_accounted:
    prompt positions [0, prompt_accounted) already charged (computed or cached; recomputation after
    a retraction is never charged again). outputs_charged: output tokens charged (a high-water mark
    of `len(output_ids)`, so a step seen twice or several tokens per step are charged once).
    """

    rid: str
    tag: TenantTag
    prompt_len: int
    max_new_tokens: int
    arrival: int
    prompt_accounted: int = 0
    outputs_charged: int = 0
    admitted: bool = False


class FairShareState:
    """Tenant accounts and per-request charging for one scheduler.

    policy: a policy name for `make_policy` (`vtc`, `vtc-pred`, `drr`, `fcfs`) or a
    `SchedulingPolicy`. cost: the cost function (default `LinearCost()`; ignored when a policy
    object is given). secret: HMAC secret for tenant tokens (None: every request is unverified).
    kv_quotas: soft KV quota per tenant, in tokens; tenants without one get their weighted share of
    the tokens the decode batch holds. retraction_base: SGLang's own retraction order
    (`reqs -> keep-first indices`), used inside each tenant; None: longest output kept first.
    """

    def __init__(self, policy: str | SchedulingPolicy = "vtc", cost: CostFunction | None = None, *,
                 secret: str | None = None, kv_quotas: dict[str, float] | None = None,
                 retraction_base: Callable[[list], list[int]] | None = None, **policy_options) -> None:
        if isinstance(policy, SchedulingPolicy):
            self.policy = policy
        else:
            self.policy = make_policy(policy, cost or LinearCost(), **policy_options)
        self.cost = self.policy.cost
        self.secret = secret
        self.kv_quotas = dict(kv_quotas or {})
        self.retraction_base = retraction_base
        self.tracked: dict[str, TrackedRequest] = {}
        self.live: dict[str, int] = {}          # tenant -> tracked requests
        self.finished: dict[str, int] = {}      # tenant -> requests ended (any reason)
        self.retractions: dict[str, int] = {}   # tenant -> requests retracted
        self._arrivals = 0
        self._used_rids: dict[str, int] = {}   # rid -> expiry of the token it was verified with (replay)
        self._token_expiries: list[tuple[int, str]] = []

    # ---- identity ---------------------------------------------------------------------------
    def tag_of(self, req) -> TenantTag:
        """The request's tenant (verified once, then cached on the request). Also enforces the
        namespace: a verified request's `extra_key` is set to the one the worker derives from its
        tenant and `cache_salt` (`tenant.extra_key_for`, plus SGLang's own LoRA id or
        `|`-separated suffixes); an unverified request's is moved under `fsu|`."""
        tag = getattr(req, TAG_ATTR, None)
        if tag is not None:
            return tag
        verified = tenant_mod.verify(tenant_mod.custom_params_token(getattr(req, "sampling_params", None)),
                                     self.secret, rid=str(getattr(req, "rid", "")))
        tag = None
        if verified is not None and self._first_use(str(req.rid), verified[1]):
            tag = verified[0]
        current = getattr(req, "extra_key", None) or ""
        if tag is not None:
            expected = (tenant_mod.extra_key_for(tag.tenant_id, getattr(req, "cache_salt", None), self.secret)
                        + (getattr(req, "lora_id", None) or ""))
            if current != expected and not current.startswith(expected + "|"):
                req.extra_key = expected
        else:
            tag = tenant_mod.unverified_tag()
            if not current.startswith(tenant_mod.UNVERIFIED_PREFIX):
                req.extra_key = tenant_mod.UNVERIFIED_PREFIX + current
        setattr(req, TAG_ATTR, tag)
        return tag

    def _first_use(self, rid: str, expiry: int) -> bool:
        """Whether this is the first request object carrying a valid token for `rid` (remembered
        until the token's expiry): a second one is a replay."""
        now = time.time()
        while self._token_expiries and self._token_expiries[0][0] < now:
            exp, old = heapq.heappop(self._token_expiries)
            if self._used_rids.get(old) == exp:
                del self._used_rids[old]
        if rid in self._used_rids:
            log.warning("fairshare: the tenant token of request %s was already used; accounting it as unverified", rid)
            return False
        self._used_rids[rid] = expiry
        heapq.heappush(self._token_expiries, (expiry, rid))
        return True

    # ---- events -----------------------------------------------------------------------------
    def on_arrival(self, req, is_retracted: bool = False) -> None:
        """Before SGLang queues `req` (`Scheduler._add_request_to_queue`). A new request marks its
        tenant backlogged, lifting its counter (VTC); a retracted or otherwise re-queued one marks
        it backlogged without a lift."""
        tag = self.tag_of(req)
        if req.rid in self.tracked:
            self.policy.account(tag.tenant_id).backlogged = True
            if is_retracted:
                self.retractions[tag.tenant_id] = self.retractions.get(tag.tenant_id, 0) + 1
            return
        if is_retracted:
            self._track(req, tag, lift=False)
            self.retractions[tag.tenant_id] = self.retractions.get(tag.tenant_id, 0) + 1
        else:
            self._track(req, tag, lift=True)

    def _track(self, req, tag: TenantTag, lift: bool) -> TrackedRequest:
        acct = self.policy.account(tag.tenant_id, tag.weight, tag.tier)
        if lift:
            self.policy.on_arrival(tag.tenant_id, tag.weight, tag.tier)
        else:
            acct.backlogged = True  # backlogged again without a lift (its work was already there)
        params = getattr(req, "sampling_params", None)
        max_new = getattr(params, "max_new_tokens", None)
        tr = TrackedRequest(rid=req.rid, tag=tag, prompt_len=len(req.origin_input_ids),
                            max_new_tokens=int(max_new) if max_new is not None else 0, arrival=self._arrivals)
        self._arrivals += 1
        self.tracked[req.rid] = tr
        self.live[tag.tenant_id] = self.live.get(tag.tenant_id, 0) + 1
        return tr

    def _get(self, req) -> TrackedRequest:
        tr = self.tracked.get(req.rid)
        if tr is None:  # queued by a path that bypassed _add_request_to_queue: account it, no lift
            tr = self._track(req, self.tag_of(req), lift=False)
        return tr

    def _end(self, tr: TrackedRequest) -> None:
        t = tr.tag.tenant_id
        self.policy.on_request_finish(t, tr.rid, tr.prompt_len, tr.outputs_charged)
        del self.tracked[tr.rid]
        self.finished[t] = self.finished.get(t, 0) + 1
        n = self.live[t] = self.live.get(t, 1) - 1
        if n <= 0:
            del self.live[t]
            self.policy.on_idle(t)

    # ---- ordering ---------------------------------------------------------------------------
    def order_waiting(self, waiting_queue: list) -> None:
        """Reorder SGLang's waiting queue in place (after `SchedulePolicy.calc_priority`).

        VTC family: each request gets its tenant's *projected* counter: the counter now plus the
        estimated prefill cost (uncached prompt tokens, per the cost function, over the weight) of
        the tenant's requests ahead of it; the queue is sorted by (projected counter, tenant id,
        position). The tenant with the smallest counter goes first and one prefill batch is shared
        among tenants the way VTC would share it request by request. Within a tenant, retracted
        requests come first, then SGLang's own order (e.g. longest prefix match).
        FCFS: SGLang's order is kept. Other policies: tenants in `policy.order(...)` order, each
        tenant's requests in SGLang's order.
        """
        if len(waiting_queue) < 2 or self.policy.name == "fcfs":
            for req in waiting_queue:
                self._get(req)
            return
        per_tenant: dict[str, list[tuple[int, object]]] = {}
        for pos, req in enumerate(waiting_queue):
            per_tenant.setdefault(self._get(req).tag.tenant_id, []).append((pos, req))
        keys: dict[int, tuple] = {}
        if self.policy.name.startswith("vtc"):
            for t, items in per_tenant.items():
                acct = self.policy.accounts[t]
                v = acct.virtual_counter
                items.sort(key=lambda it: (not getattr(it[1], "is_retracted", False), it[0]))
                for k, (pos, req) in enumerate(items):
                    keys[id(req)] = (v, t, k)
                    v += self._estimated_prefill(req) / acct.weight
        else:
            heads = {t: min(self.tracked[r.rid].arrival for _, r in items) for t, items in per_tenant.items()}
            rank = {t: i for i, t in enumerate(self.policy.order(sorted(per_tenant), heads))}
            for t, items in per_tenant.items():
                items.sort(key=lambda it: (not getattr(it[1], "is_retracted", False), it[0]))
                for k, (pos, req) in enumerate(items):
                    keys[id(req)] = (rank[t], t, k)
        waiting_queue.sort(key=lambda r: keys[id(r)])

    def _estimated_prefill(self, req) -> float:
        tr = self.tracked[req.rid]
        start = max(int(getattr(req, "prefix_len", 0) or 0), tr.prompt_accounted)
        return self.cost.prefill(max(0, tr.prompt_len - start), 0, start=tr.prompt_accounted)

    # ---- charging ---------------------------------------------------------------------------
    def charge_prefill(self, reqs: Iterable, skip: Sequence = ()) -> float:
        """Charge the prefill a new batch will compute (after `Scheduler.get_new_batch_prefill`).

        For each request, this round extends positions [prefix_len, extend_end). Prompt positions
        not yet accounted are charged: those SGLang computes at α each, those it found in the radix
        cache (below prefix_len, first time only) at the cost function's cached rate. Output
        positions recomputed after a retraction, and prompt positions recomputed after one, are not
        charged again. `skip`: requests riding along as decodes (mixed chunked prefill), charged
        per output token instead. Returns the units charged.
        """
        skip_ids = {id(r) for r in skip}
        total = 0.0
        for req in reqs:
            if id(req) in skip_ids or getattr(req, "extend_end", None) is None:
                continue
            tr = self._get(req)
            t = tr.tag.tenant_id
            if not tr.admitted:
                tr.admitted = True
                self.policy.on_admit(t, tr.rid, tr.prompt_len, tr.max_new_tokens)
            lo, hi, p = int(req.prefix_len), int(req.extend_end), tr.prompt_len
            done = tr.prompt_accounted
            cached = max(0, min(lo, p) - done)
            start = max(lo, done)
            computed = max(0, min(hi, p) - start)
            if cached or computed:
                units = self.cost.prefill(computed, cached, start=done)
                self.policy.charge(t, units, prompt_tokens=computed, request_id=tr.rid)
                tr.prompt_accounted = max(done, min(hi, p))
                total += units
        return total

    def charge_outputs(self, reqs: Iterable) -> float:
        """Charge committed output tokens and retire finished requests (after
        `Scheduler.process_batch_result`). Idempotent per step: a request is charged for
        `len(output_ids)` minus what it was already charged, so several tokens in one step
        (speculative decoding) are all charged and a step processed twice (overlap scheduling) is
        charged once. Returns the units charged."""
        total = 0.0
        for req in reqs:
            tr = self.tracked.get(req.rid)
            if tr is None:
                if req.finished():
                    continue
                tr = self._get(req)
            n = len(req.output_ids) - tr.outputs_charged
            if n > 0:
                units = self.cost.decode(n, tr.prompt_len, tr.outputs_charged)
                self.policy.charge(tr.tag.tenant_id, units, output_tokens=n, request_id=tr.rid)
                tr.outputs_charged += n
                total += units
            if req.finished():
                self._end(tr)
        return total

    def mark_idle(self, pending_reqs: Iterable) -> list[str]:
        """Tell the policy which tenants stopped being backlogged, after a scheduling pass.

        Backlogged is the reference scheduler's definition (worker/engine/scheduler.py): queued
        requests or prefill left. `pending_reqs`: SGLang's waiting queue plus the request whose
        chunked prefill continues. A tenant whose requests are all past prefill is idle even while
        they decode (VTC, Sheng et al. OSDI 2024, Algorithm 2), so its next new request is lifted.
        Returns the tenants marked idle, in account order.
        """
        pending = {self.tag_of(r).tenant_id for r in pending_reqs if r is not None}
        idle = [a.tenant_id for a in self.policy.backlogged() if a.tenant_id not in pending]
        for t in idle:
            self.policy.on_idle(t)
        return idle

    def reconcile(self, live_reqs: Iterable) -> list[str]:
        """Retire tracked requests that are no longer anywhere in the scheduler (aborted while
        waiting: SGLang pops them from the queue without a batch result). Returns their ids."""
        live = {r.rid for r in live_reqs if r is not None}
        gone = [rid for rid in self.tracked if rid not in live]
        for rid in gone:
            self._end(self.tracked[rid])
        return gone

    # ---- retraction -------------------------------------------------------------------------
    def retraction_order(self, reqs: list) -> list[int]:
        """Indices of `reqs` from most- to least-preferred to keep (SGLang retracts from the end).

        Over-quota first: the next request to retract is taken from the tenant furthest over its
        soft KV quota (held tokens / quota, recomputed as requests are taken away; ties by tenant
        id), and within that tenant it is the one SGLang itself would retract first. So a tenant
        within its quota loses nothing while an over-quota tenant still holds decoding requests.
        Held tokens: prompt plus output tokens of each request. Quota: `kv_quotas[tenant]` tokens,
        else the tenant's weighted share of all tokens held by the batch.
        """
        if not reqs:
            return []
        base = list(self.retraction_base(reqs)) if self.retraction_base else sorted(
            range(len(reqs)), key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids)), reverse=True)
        groups: dict[str, list[int]] = {}
        weights: dict[str, float] = {}
        held: dict[str, float] = {}
        size = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
        for i in base:
            tag = self.tag_of(reqs[i])
            groups.setdefault(tag.tenant_id, []).append(i)
            weights[tag.tenant_id] = tag.weight
            held[tag.tenant_id] = held.get(tag.tenant_id, 0) + size[i]
        total = sum(held.values())
        wsum = sum(weights.values())
        quota = {t: max(1e-9, float(self.kv_quotas.get(t, total * weights[t] / wsum))) for t in groups}
        retract_first: list[int] = []
        while groups:
            t = max(groups, key=lambda u: (held[u] / quota[u], u))
            i = groups[t].pop()
            retract_first.append(i)
            held[t] -= size[i]
            if not groups[t]:
                del groups[t]
        return retract_first[::-1]

    # ---- introspection ----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Per-tenant counters (for logs and tests)."""
        out = {}
        for t, a in sorted(self.policy.accounts.items()):
            out[t] = {"weight": a.weight, "tier": a.tier, "virtual_counter": a.virtual_counter,
                      "charged_service": a.charged_service, "prompt_tokens": a.prompt_tokens,
                      "output_tokens": a.output_tokens, "backlogged": a.backlogged, "live": self.live.get(t, 0),
                      "finished": self.finished.get(t, 0), "retractions": self.retractions.get(t, 0)}
        return out
