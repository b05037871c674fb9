"""Simulated model runner and virtual clock: the engine loop, without the model.

`SimulatedRunner` plugs into the same `Engine` (and so the same `Scheduler` and policies) as the
torch runner. Its `forward(items)` computes nothing: it advances a `VirtualClock` by the modelled
iteration time and returns one token id per item (`returns_token_ids = True`), always the same
non-EOS token, so each request produces exactly its `max_tokens` outputs (the workload's output
length). It imports no torch.

Iteration time model (seconds), fitted by `fairshare sim calibrate` (loadtests/sim/calibrate.py):

    t = a + b·prefill_tokens + c·batch_size + d·context_tokens

prefill_tokens: tokens of items with more than one token (prefill chunks); batch_size: items in
the step; context_tokens: Σ over items of the positions attended (start_pos + new tokens).
`ClockedRunner` wraps a real runner so that a real engine run is timed by the same model on a
virtual clock (deterministic latency figures for tests; the logits are real).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from fairshare.checks import require_at_least


class VirtualClock:
    """A clock that only moves when told: `clock()` returns seconds since the start (float)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` (>= 0); returns the new time. Raises ValueError if negative."""
        if seconds < 0:
            raise ValueError("a virtual clock cannot go backwards")
        self.now += seconds
        return self.now

    def advance_to(self, t: float) -> float:
        """Move to time `t` if it is later than now; returns the new time."""
        self.now = max(self.now, float(t))
        return self.now


@dataclass(frozen=True)
class IterationTimeModel:
    """`t = a + b·prefill_tokens + c·batch_size + d·context_tokens` seconds per engine iteration.

    a: fixed cost per step (s). b: per prefill token (s/token). c: per sequence in the batch
    (s/sequence). d: per context token attended (s/token). source: where the figures came from
    (e.g. "calibrated: random-tiny, cpu, 2 threads"). Raises ValueError on negative coefficients
    or an all-zero model.
    """

    a: float
    b: float
    c: float
    d: float
    source: str = "manual"

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c, self.d) < 0 or max(self.a, self.b, self.c, self.d) <= 0:
            raise ValueError("iteration time coefficients must be >= 0 and not all zero")

    def step_time(self, prefill_tokens: int, batch_size: int, context_tokens: int) -> float:
        """Seconds one iteration takes."""
        return self.a + self.b * prefill_tokens + self.c * batch_size + self.d * context_tokens

    def faster(self, factor: float) -> "IterationTimeModel":
        """The same model for a server `factor` times as fast (every coefficient divided by it): the
        pool simulator's single worker with a pool's total capacity. Raises ValueError unless factor > 0."""
        if not factor > 0:
            raise ValueError("factor must be > 0")
        return IterationTimeModel(self.a / factor, self.b / factor, self.c / factor, self.d / factor,
                                  f"{self.source}, {factor:g}x as fast" if factor != 1 else self.source)

    def wider(self, factor: float) -> "IterationTimeModel":
        """The same model for a server with `factor` times the hardware that runs `factor` times the
        batch in one iteration (the per-token and per-sequence coefficients b, c, d divided by it, the
        fixed per-iteration cost a kept): an iteration over `factor` pool workers' batches takes as long
        as one pool worker's over its own. The pool simulator's pool-shaped single worker. Raises
        ValueError unless factor > 0."""
        if not factor > 0:
            raise ValueError("factor must be > 0")
        return IterationTimeModel(self.a, self.b / factor, self.c / factor, self.d / factor,
                                  f"{self.source}, {factor:g}x as wide" if factor != 1 else self.source)

    def describe(self) -> str:
        return (f"t = {self.a * 1e3:.3f} ms + {self.b * 1e6:.2f} us*prefill_tokens + {self.c * 1e6:.2f} us*batch_size"
                f" + {self.d * 1e9:.2f} ns*context_tokens  ({self.source})")

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "IterationTimeModel":
        """Read a profile written by `save` (or `fairshare sim calibrate`). Raises OSError / ValueError."""
        data = json.loads(Path(path).read_text())
        return cls(float(data["a"]), float(data["b"]), float(data["c"]), float(data["d"]), str(data.get("source", path)))


def batch_shape(items) -> tuple[int, int, int]:
    """(prefill_tokens, batch_size, context_tokens) of a list of forward items."""
    prefill = context = 0
    for it in items:
        n = len(it.token_ids)
        if n > 1:
            prefill += n
        context += it.start_pos + n
    return prefill, len(items), context


@dataclass
class SimItem:
    """Same fields as `worker.engine.model_runner.ForwardItem` (token_ids, start_pos, block_table)."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


class SimulatedRunner:
    """A runner that only advances time.

    clock: the engine's `VirtualClock`. time_model: `IterationTimeModel`. num_kv_blocks /
    block_size: the KV pool the block manager manages (tokens = blocks × block_size).
    vocab_size: token ids the engine accepts in prompts. token_id: the id every step returns (must
    not be an EOS id of the sim model). jitter: relative standard deviation of a multiplicative
    noise on step times (0 = none), drawn from `random.Random(seed)`, so runs are deterministic
    per seed. Raises ValueError on bad sizes.
    """

    returns_token_ids = True
    item_class = SimItem

    def __init__(self, clock: VirtualClock, time_model: IterationTimeModel, num_kv_blocks: int, block_size: int = 16,
                 vocab_size: int = 32000, token_id: int = 1, jitter: float = 0.0, seed: int = 0) -> None:
        require_at_least(1, num_kv_blocks=num_kv_blocks, block_size=block_size)
        require_at_least(0, jitter=jitter)
        self.clock = clock
        self.time_model = time_model
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.token_id = token_id
        self.jitter = jitter
        self._rng = random.Random(seed)
        self.steps = 0
        self.busy_s = 0.0

    def forward(self, items) -> list[int]:
        """Advance the clock by the modelled time of this batch; return one token id per item."""
        dt = self.time_model.step_time(*batch_shape(items))
        if self.jitter:
            dt *= max(0.0, self._rng.gauss(1.0, self.jitter))
        self.clock.advance(dt)
        self.steps += 1
        self.busy_s += dt
        return [self.token_id] * len(items)


class SimModel:
    """The model fields the engine reads, for simulation: no tokenizer (no text), EOS id 0."""

    def __init__(self, max_context_tokens: int = 32768, name: str = "simulated") -> None:
        self.name = name
        self.tokenizer = None
        self.eos_token_ids = [0]
        self.max_context_tokens = max_context_tokens


class ClockedRunner:
    """Wraps a real runner: real `forward`, but each step advances `clock` by `time_model`'s time
    for that batch, so an engine driven with this clock has deterministic timings."""

    def __init__(self, inner, clock: VirtualClock, time_model: IterationTimeModel) -> None:
        self.inner = inner
        self.clock = clock
        self.time_model = time_model
        self.block_size = inner.block_size
        self.num_kv_blocks = inner.num_kv_blocks
        self.vocab_size = inner.vocab_size

    def forward(self, items):
        out = self.inner.forward(items)
        self.clock.advance(self.time_model.step_time(*batch_shape(items)))
        return out
