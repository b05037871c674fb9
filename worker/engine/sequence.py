"""A request inside the engine: its tokens, KV block table, sampling parameters and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued (never admitted, or preempted and waiting to be recomputed)
    RUNNING = "running"    # admitted: holds KV blocks; in prefill (chunks left) or decode
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"       # EOS, a stop token id or a stop string
    LENGTH = "length"   # max_tokens reached or the context is full
    ABORT = "abort"     # cancelled by the client, the gateway or shutdown
    HANDED_BACK = "handed_back"  # never admitted: given back to the gateway to re-route (worker/scheduling/handback.py)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass
class SamplingParams:
    """Per-request sampling. max_tokens: output tokens (None = rest of the context).
    temperature 0 = greedy; top_p in (0, 1] (1 = off); top_k <= 0 = off; seed makes sampling
    reproducible; stop: strings that end generation and are never emitted; stop_token_ids:
    token ids that end generation (not emitted as text); ignore_eos: keep going past EOS.
    logprobs: return each committed token's log probability (worker/engine/sampler.py says which
    distribution); top_logprobs: that many most likely alternatives too (0-20). grammar: an
    xgrammar compiled grammar (`worker.engine.grammar.GrammarCompiler.compile`) constraining the
    output; None = free."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: object | None = None

    def validate(self) -> None:
        """Raise ValueError for out-of-range values."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")


@dataclass
class Sequence:
    """One generation request.

    Token accounting: `all_token_ids` = prompt + committed outputs; the first `num_computed_tokens`
    of them have K/V in the paged cache (block ids in `block_table`, `block_size` tokens each).
    After a recompute preemption `num_computed_tokens` returns to 0 and prompt + outputs so far are
    prefilled again. `num_charged_prefill` is the high-water mark of prompt-side tokens already
    charged, so recomputation is not charged twice (declared rule: recompute after preemption is
    the platform's cost, not the tenant's). With the prefix cache, admission may start
    `num_computed_tokens` at a block-aligned cached prefix (its blocks shared, reference-counted);
    `num_cached_tokens` counts the prompt tokens so served, charged at the declared cached rate.
    `cache_namespace` is the radix-cache namespace (derived by the engine from the tenant).
    """

    request_id: str
    tenant_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    weight: float = 1.0
    tier: str = "interactive"
    cache_namespace: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16                  # effective: min(requested, context left)
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""                 # detokenized output (stop strings included until cut)
    emitted_text_len: int = 0             # chars of output_text already streamed
    emitted_token_count: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache (charged at the cached rate)
    num_cache_inserted_blocks: int = 0    # leading blocks of block_table already offered to the cache
    num_charged_prefill: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    admitted_order: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    arrival_iteration: int = 0            # engine iterations started before it reached the engine
    first_scheduled_iteration: int | None = None
    first_token_iteration: int | None = None
    finish_time: float | None = None
    detokenizer: object | None = None
    generator: object | None = None
    constraint: object | None = None      # grammar state (worker/engine/grammar.Constraint) when constrained
    output_logprobs: list = field(default_factory=list)  # (token, logprob, top) per output token, when asked
    may_hand_back: bool = False           # the gateway lets this worker hand it back before admission
    final_only: bool = False              # its caller takes only the final output (Engine.add_request)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is not in the cache yet (1 in decode, more while prefilling)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
