"""The plugin on SGLang 0.5.23's real classes (CPU; .venv-sglang built by scripts/ci-sglang-env.sh).

The plugin is loaded the way SGLang loads it in each scheduler process: `load_plugins()` finds the
`sglang.srt.plugins` entry point `fairshare` and `HookRegistry.apply_hooks()` patches the targets.
Then:
- arrival runs through SGLang's own (patched) `Scheduler._add_request_to_queue` on a minimal
  stand-in scheduler (a real `Scheduler` needs a GPU model runner);
- ordering runs through the real `SchedulePolicy.calc_priority` (FCFS and LPM, with a real
  simulated radix cache);
- retraction order runs through the real (replaced) `ScheduleBatch._get_decode_retraction_order`;
- the two AFTER hooks on `Scheduler` are checked to be installed on it, and are called with real
  `NextBatchPlan` / `ScheduleBatch` / `Req` objects set up as SGLang's prefill adder and result
  processor leave them (prefix lengths from SGLang's own `Req.init_next_round_input` matching);
- namespace isolation is checked in SGLang's own `RadixCache`.
"""

from __future__ import annotations

import inspect
import os
from array import array

import pytest

from tests.sglang import cpu_sglang

cpu_sglang.prepare()

SECRET = "hook-test-secret"
os.environ.setdefault("FAIRSHARE_SGLANG_SECRET", SECRET)
os.environ.pop("FAIRSHARE_SGLANG_POLICY", None)

import sglang  # noqa: E402
import sglang.srt.managers.scheduler as scheduler_mod  # noqa: E402  (plugins hook only where the scheduler is imported)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.schedule_batch import NextBatchPlan, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from worker.scheduling.cost import LinearCost  # noqa: E402
from worker.sglang_plugin import hooks  # noqa: E402
from worker.sglang_plugin import tenant as tn  # noqa: E402
from worker.sglang_plugin.state import FairShareState  # noqa: E402

Scheduler = scheduler_mod.Scheduler


@pytest.fixture(scope="module", autouse=True)
def sglang_runtime():
    """SGLang's own test config (a dummy ServerArgs published process-wide), then the plugins."""
    override = get_context().override_server_args()
    override.install()
    load_plugins()
    yield
    override.restore()


@pytest.fixture
def state():
    """A fresh plugin state per test, with SGLang's original retraction order inside tenants."""
    original = ScheduleBatch.__dict__["_get_decode_retraction_order"].__func__.__wrapped__
    st = FairShareState("vtc", LinearCost(1.0, 2.0), secret=os.environ["FAIRSHARE_SGLANG_SECRET"],
                        retraction_base=original)
    previous = hooks.get_state()
    hooks.set_state(st)
    yield st
    hooks.set_state(previous)


class StubScheduler:
    """What `Scheduler._add_request_to_queue` touches in the non-disaggregated path."""

    disaggregation_mode = DisaggregationMode.NULL
    dllm_config = None
    chunked_req = None
    last_batch = None

    def __init__(self):
        self.waiting_queue = []
        self.processed_tokens_counter = 0
        self.running_batch = ScheduleBatch(reqs=[])

    def _set_or_validate_priority(self, req):
        return True

    def _abort_on_queued_limit(self, req):
        return False

    def _prefetch_kvcache(self, req):
        return None


def make_req(rid, tenant, tokens, weight=1.0, salt=None, signed=True, max_new=32):
    """A real SGLang Req as `fairshare worker --engine sglang` would make it for `tenant`."""
    secret = os.environ["FAIRSHARE_SGLANG_SECRET"]
    custom = {tn.CUSTOM_PARAM_KEY: tn.sign(tenant, weight, "interactive", secret, rid=rid)}
    sp = SamplingParams(max_new_tokens=max_new, custom_params=custom if signed else None)
    return Req(rid, "", array("q", tokens), sp, extra_key=tn.extra_key_for(tenant, salt, secret), cache_salt=salt)


def arrive(sched, *reqs, retracted=False):
    for r in reqs:
        Scheduler._add_request_to_queue(sched, r, is_retracted=retracted)


def counter(state, tenant):
    return state.policy.accounts[tenant].virtual_counter


# ---- the hooks are installed on SGLang's classes --------------------------------------------------
def _hook_of(fn):
    return inspect.getclosurevars(fn).nonlocals.get("hook")


def test_plugin_loaded_through_entry_point_and_hooks_applied():
    assert sglang.__version__ == "0.5.23"
    assert _hook_of(Scheduler._add_request_to_queue) is hooks.before_add_request_to_queue
    assert _hook_of(Scheduler.get_new_batch_prefill) is hooks.after_get_new_batch_prefill
    assert _hook_of(Scheduler.process_batch_result) is hooks.after_process_batch_result
    assert _hook_of(SchedulePolicy.calc_priority) is hooks.after_calc_priority
    assert isinstance(ScheduleBatch.__dict__["_get_decode_retraction_order"], staticmethod)
    assert _hook_of(ScheduleBatch._get_decode_retraction_order) is hooks.replace_decode_retraction_order


# ---- arrival and lift ----------------------------------------------------------------------------
def test_lift_on_arrival_but_not_for_retracted(state):
    sched = StubScheduler()
    a1 = make_req("a1", "A", [1, 2, 3])
    arrive(sched, a1)
    assert sched.waiting_queue == [a1]          # SGLang's own method queued it
    assert a1.fairshare_tag.tenant_id == "A" and a1.fairshare_tag.verified
    state.policy.charge("A", 300.0)
    b1 = make_req("b1", "B", [4, 5])
    arrive(sched, b1)
    assert counter(state, "B") == 300.0         # lifted to the backlogged minimum
    b1.output_ids.extend([9])
    b1.finished_reason = object()               # B's only request ends: B idles
    state.charge_outputs([b1])
    assert not state.policy.accounts["B"].backlogged
    state.policy.charge("A", 500.0)             # A keeps being served (counter 800)
    b2 = make_req("b2", "B", [4, 5])
    arrive(sched, b2, retracted=True)           # a retracted request the core never saw is new to it: lifted
    assert counter(state, "B") == 800.0 and state.policy.accounts["B"].backlogged
    b3 = make_req("b3", "B", [6, 7])
    b2.finished_reason = object()               # B idles again
    state.charge_outputs([b2])
    arrive(sched, b3)                           # a genuinely new request: lifted to A's 800
    assert counter(state, "B") == 800.0


def test_unsigned_request_is_not_attributed_and_leaves_tenant_namespaces(state):
    sched = StubScheduler()
    forged = make_req("x", "A", [1, 2, 3], signed=False)      # claims A's namespace, no valid token
    forged.sampling_params.custom_params = {tn.CUSTOM_PARAM_KEY: tn.sign("A", 9.0, "interactive", "guess", rid="x")}
    arrive(sched, forged)
    assert forged.fairshare_tag.tenant_id == tn.UNVERIFIED_TENANT
    assert forged.extra_key.startswith(tn.UNVERIFIED_PREFIX)
    assert "A" not in state.policy.accounts


# ---- ordering ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sglang_policy", ["fcfs", "lpm"])
def test_calc_priority_orders_by_tenant_counter(state, sglang_policy):
    sched = StubScheduler()
    a = [make_req(f"a{i}", "A", [10 + i] * 50) for i in range(3)]
    b = [make_req(f"b{i}", "B", [20 + i] * 50) for i in range(2)]
    arrive(sched, *a, *b)                       # A's three arrive first
    state.policy.charge("A", 120.0)             # and A has been served more
    policy = SchedulePolicy(sglang_policy, RadixCache.create_simulated(), False, False, False)
    queue = list(sched.waiting_queue)
    policy.calc_priority(queue)
    # B at 0 (+50 per request), A at 120 (+50): b0 0, b1 50, a0 120, a1 170, a2 220
    assert [r.rid for r in queue] == ["b0", "b1", "a0", "a1", "a2"]
    state.policy.charge("B", 100.0)             # B at 100: b0 100, a0 120, b1 150, a1 170, a2 220
    policy.calc_priority(queue)
    assert [r.rid for r in queue] == ["b0", "a0", "b1", "a1", "a2"]


# ---- charging ------------------------------------------------------------------------------------
def test_prefill_charges_uncached_tokens_only(state):
    sched = StubScheduler()
    tree = RadixCache.create_simulated()
    system = list(range(100, 140))                              # a 40-token shared system prompt
    warm = make_req("warm", "A", system + [1])
    key = RadixKey(array("q", system), extra_key=warm.extra_key)
    tree.insert(InsertParams(key=key, value=__import__("torch").arange(len(system))))   # A computed it before
    r = make_req("r", "A", system + list(range(60)))            # 100 tokens, 40 of them cached for A
    arrive(sched, r)
    r.init_next_round_input(tree)                               # SGLang's own prefix match
    assert r.prefix_len == 40
    r.extend_end = 72                                           # the adder's chunk: [40, 72)
    plan = NextBatchPlan(batch_to_run=ScheduleBatch(reqs=[r]), running_batch=ScheduleBatch(reqs=[]))
    hooks.after_get_new_batch_prefill(plan, sched, sched.running_batch)
    acct = state.policy.accounts["A"]
    assert (acct.prompt_tokens, acct.charged_service) == (32, 32.0)
    r.prefix_len, r.extend_end = 72, 100                        # next chunk
    hooks.after_get_new_batch_prefill(plan, sched, sched.running_batch)
    assert (acct.prompt_tokens, acct.charged_service) == (60, 60.0)
    # the same request retracted and recomputed: no prompt token is charged twice
    r.prefix_len, r.extend_end = 0, 100
    hooks.after_get_new_batch_prefill(plan, sched, sched.running_batch)
    assert acct.charged_service == 60.0


def test_decode_tokens_charged_once_with_overlap_and_multi_token_steps(state):
    sched = StubScheduler()
    r = make_req("r", "A", [1, 2, 3])
    arrive(sched, r)
    batch = ScheduleBatch(reqs=[r])
    r.output_ids.append(11)                                     # prefill result: first token
    hooks.after_process_batch_result(None, sched, batch, None)
    r.output_ids.extend([12, 13, 14])                           # one step, three tokens (speculative)
    hooks.after_process_batch_result(None, sched, batch, None)
    hooks.after_process_batch_result(None, sched, batch, None)  # the same step seen again (overlap)
    acct = state.policy.accounts["A"]
    assert (acct.output_tokens, acct.charged_service) == (4, 8.0)
    r.finished_reason = object()
    hooks.after_process_batch_result(None, sched, batch, None)
    assert "r" not in state.tracked and not acct.backlogged and acct.output_tokens == 4


def test_requests_aborted_while_waiting_are_retired(state):
    sched = StubScheduler()
    a, b = make_req("a", "A", [1]), make_req("b", "A", [2])
    arrive(sched, a, b)
    sched.waiting_queue.remove(b)              # what Scheduler.abort_request does to a waiting request
    hooks.after_get_new_batch_prefill(NextBatchPlan(batch_to_run=None, running_batch=ScheduleBatch(reqs=[])),
                                      sched, sched.running_batch)
    assert list(state.tracked) == ["a"] and state.live == {"A": 1}


# ---- retraction ----------------------------------------------------------------------------------
def test_retraction_order_over_quota_first(state):
    sched = StubScheduler()
    a = [make_req(f"a{i}", "A", [1] * 80) for i in range(3)]   # A holds 3 x 100 tokens
    b = [make_req(f"b{i}", "B", [2] * 80) for i in range(2)]   # B holds 2 x 100 tokens
    for r in a + b:
        r.output_ids.extend([5] * 20)
    arrive(sched, *a, *b)
    reqs = [b[0], a[0], b[1], a[1], a[2]]
    plain = ScheduleBatch.__dict__["_get_decode_retraction_order"].__func__.__wrapped__(reqs)
    order = ScheduleBatch._get_decode_retraction_order(reqs)    # SGLang calls it like this
    assert sorted(order) == list(range(5))
    retract_first = [reqs[i].rid for i in reversed(order)]
    # equal weights: quotas 250 tokens each. A (300) is over: its request goes first; then A and B
    # are both at 200/250 (tie broken by tenant id, deterministic), and so on.
    assert retract_first[0].startswith("a")
    # within a tenant SGLang's own preference is kept
    sglang_a = [reqs[i].rid for i in reversed(plain) if reqs[i].rid.startswith("a")]
    assert [x for x in retract_first if x.startswith("a")] == sglang_a


def test_weighted_tenant_within_quota_is_not_retracted_while_another_is_over(state):
    sched = StubScheduler()
    heavy = [make_req(f"h{i}", "H", [1] * 100, weight=3.0) for i in range(3)]   # weight 3, 300 tokens
    light = [make_req(f"l{i}", "L", [2] * 100, weight=1.0) for i in range(2)]   # weight 1, 200 tokens
    arrive(sched, *heavy, *light)
    reqs = heavy + light
    order = ScheduleBatch._get_decode_retraction_order(reqs)
    # quotas: H 375, L 125 of 500 tokens. L (200 > 125) is over; H is within: L's go first.
    assert [reqs[i].rid[0] for i in reversed(order)][:1] == ["l"]
    assert [reqs[i].rid[0] for i in order][:3] == ["h", "h", "h"]


# ---- namespace isolation in SGLang's radix cache ---------------------------------------------------
def test_tenants_identical_prompts_share_no_radix_nodes(state):
    sched = StubScheduler()
    tree = RadixCache.create_simulated()
    prompt = list(range(1000, 1064))
    a1, b1 = make_req("a1", "A", prompt), make_req("b1", "B", prompt)
    arrive(sched, a1, b1)
    # A's request computed the prompt: its KV is inserted under A's namespace
    tree.insert(InsertParams(key=RadixKey(array("q", prompt), extra_key=a1.extra_key, cache_salt=a1.cache_salt),
                             value=__import__("torch").arange(len(prompt))))

    def match(req):
        return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt), extra_key=req.extra_key,
                                                                cache_salt=req.cache_salt))).device_prefix_len

    a2 = make_req("a2", "A", prompt)
    salted = make_req("a3", "A", prompt, salt="client-salt")
    forged = make_req("x", "A", prompt, signed=False)           # an unverified request naming A's key
    arrive(sched, a2, salted, forged)
    assert match(a2) == len(prompt)                              # A reuses its own prefix
    assert match(b1) == 0                                        # B: the same tokens, nothing shared
    assert match(salted) == 0                                    # a client salt splits A's own namespace
    assert match(forged) == 0                                    # an unverified request cannot reach it
    b1.init_next_round_input(tree)                               # SGLang's own request-side matching
    assert b1.prefix_len == 0
    a2.init_next_round_input(tree)
    assert a2.prefix_len == len(prompt) - 1                      # (SGLang keeps >= 1 token to compute)
    # no node under the root is shared: each top-level child belongs to exactly one namespace
    owners = [child.key.extra_key for child in tree.root_node.children.values()]
    assert owners.count(a1.extra_key) == 1 and b1.extra_key not in owners
