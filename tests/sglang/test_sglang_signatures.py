"""Every SGLang 0.5.23 name FairShare relies on exists, with the signature the code assumes.

Checked on the installed wheel (not on copies of its source): the hook targets in
`worker.sglang_plugin.hooks.HOOKS`, the plugin framework, the `Req` / batch fields the plugin
reads, and the engine-side API `worker.sglang_server` calls.
"""

from __future__ import annotations

import inspect
import pkgutil

import pytest

from tests.sglang import cpu_sglang

cpu_sglang.prepare()

import sglang  # noqa: E402

from worker.sglang_plugin.hooks import HOOKS  # noqa: E402


def _original(target: str):
    """The target as SGLang defines it (unwrapping a hook that may already be applied)."""
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = inspect.getattr_static(owner, name)
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    return raw, inspect.unwrap(fn)


def test_installed_version():
    assert sglang.__version__ == "0.5.23"


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.target.rsplit(".", 2)[-2] + "." + h.target.rsplit(".", 1)[-1])
def test_hook_target_signature(hook):
    raw, fn = _original(hook.target)
    assert isinstance(raw, staticmethod) == hook.static
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == [name for name, _ in hook.params], hook.target
    for p, (name, default) in zip(params, hook.params):
        expected = inspect.Parameter.empty if default is ... else default
        assert p.default == expected, f"{hook.target}: {name} default {p.default!r}, expected {expected!r}"


def test_plugin_framework():
    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert plugins.GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert {"BEFORE", "AFTER", "AROUND", "REPLACE"} <= set(HookType.__members__)
    assert list(inspect.signature(HookRegistry.register).parameters)[:3] == ["target", "hook", "hook_type"]
    assert callable(plugins.load_plugins) and callable(HookRegistry.apply_hooks)
    from importlib.metadata import entry_points

    assert "worker.sglang_plugin:register" in [ep.value for ep in entry_points(group="sglang.srt.plugins")]


def test_request_and_batch_fields():
    from array import array

    from sglang.srt.managers.schedule_batch import NextBatchPlan, Req, ScheduleBatch
    from sglang.srt.sampling.sampling_params import SamplingParams

    init = inspect.signature(Req.__init__).parameters
    for name in ("rid", "origin_input_ids", "sampling_params", "extra_key", "cache_salt", "lora_id"):
        assert name in init, name
    r = Req("r", "", array("q", [1, 2]), SamplingParams(max_new_tokens=4, custom_params={"k": "v"}),
            extra_key="e", cache_salt="s")
    for name in ("rid", "origin_input_ids", "output_ids", "prefix_len", "extend_end", "is_retracted",
                 "extra_key", "cache_salt", "lora_id"):
        assert hasattr(r, name), name
    assert r.sampling_params.custom_params == {"k": "v"} and r.sampling_params.max_new_tokens == 4
    assert r.finished() is False and isinstance(r.output_ids, array)
    assert {"batch_to_run", "running_batch"} <= set(NextBatchPlan.__struct_fields__)
    b = ScheduleBatch(reqs=[r])
    assert b.reqs == [r] and b.decoding_reqs is None
    assert "cache_salt" in inspect.signature(__import__(
        "sglang.srt.mem_cache.radix_cache", fromlist=["RadixKey"]).RadixKey.__init__).parameters


def test_scheduler_state_the_plugin_reads():
    src = inspect.getsource(pkgutil.resolve_name("sglang.srt.managers.scheduler.Scheduler"))
    for attr in ("self.waiting_queue", "self.chunked_req", "self.running_batch", "self.last_batch",
                 "self.disaggregation_mode", "self.dllm_config", "self.result_queue"):
        assert attr in src, attr
    # waiting requests are aborted by rid prefix: sglang_server's rids are fixed-length for that
    assert "req.rid.startswith(recv_req.rid)" in src


def test_prefill_adder_internals_fairshare_prefill_adder_overrides():
    """`FairSharePrefillAdder` admits on the room there is now by overriding two PrefillAdder
    methods and resetting the budget's `total_offset` (docs/sglang-backend.md "cannot" 4): if SGLang
    renames them the override would silently do nothing, so their parameters and the budget fields
    are pinned here, and `add_one_req` must still route its memory check through them."""
    adder = pkgutil.resolve_name("sglang.srt.managers.schedule_policy.PrefillAdder")
    check = list(inspect.signature(adder._check_prefill_budget).parameters)
    assert check == ["self", "req", "extend_input_len", "total_tokens", "swa_host_hit_length", "chunk_limit"], check
    update = list(inspect.signature(adder._update_prefill_budget).parameters)
    assert update[:4] == ["self", "prefix_len", "extend_input_len", "max_new_tokens"], update
    assert "self._check_prefill_budget(" in inspect.getsource(adder._select_prefill_admission)
    assert "self._update_prefill_budget(" in inspect.getsource(adder._commit_prefill_admission)
    assert "self._swa_new_tokens(req)" in inspect.getsource(adder._check_prefill_budget)
    budget = pkgutil.resolve_name("sglang.srt.mem_cache.prefill_budget.PrefillBudget")
    src = inspect.getsource(budget)
    for attr in ("self.total_offset", "self.current_offset", "def remaining_total", "def reserve"):
        assert attr in src, attr


def test_engine_api_used_by_sglang_server():
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams

    fields = set(inspect.signature(GenerateReqInput).parameters)
    assert {"input_ids", "sampling_params", "rid", "stream", "extra_key", "cache_salt", "return_logprob",
            "logprob_start_len", "top_logprobs_num"} <= fields
    sp = set(inspect.signature(SamplingParams).parameters)
    assert {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
            "sampling_seed", "custom_params", "skip_special_tokens", "json_schema", "regex", "ebnf",
            "structural_tag"} <= sp
    assert list(inspect.signature(TokenizerManager.generate_request).parameters)[:3] == ["self", "obj", "request"]
    assert "rid" in inspect.signature(TokenizerManager.abort_request).parameters
    assert callable(TokenizerManager.auto_create_handle_loop)
    assert hasattr(sglang, "Engine")


def test_logprobs_and_grammars_reach_sglang_as_it_reads_them():
    """`request_to_sglang`'s logprob and grammar arguments build SGLang's own request objects, and the
    logprob lists StreamTranslator reads are the ones SGLang slices for incremental streams."""
    import json

    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from fairshare.v1 import worker_pb2
    from worker import sglang_server as ss

    facts = ss.ModelFacts(name="m", max_context_tokens=64, vocab_size=100)
    req = worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], tenant=worker_pb2.Tenant(id="a"))
    req.sampling.max_tokens = 4
    req.sampling.logprobs, req.sampling.top_logprobs = True, 3
    req.sampling.grammar.json_schema = json.dumps({"type": "object"})
    kw = ss.request_to_sglang(req, facts, "sec")
    obj = GenerateReqInput(**kw)
    assert obj.return_logprob is True and obj.top_logprobs_num == 3 and obj.logprob_start_len == -1
    params = SamplingParams(**kw["sampling_params"])
    assert params.json_schema == '{"type": "object"}'
    params.verify(100)  # SGLang's own check: one constraint at most, values in range
    keys = tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS
    assert {"output_token_logprobs", "output_top_logprobs"} <= set(keys)
