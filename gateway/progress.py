"""How long running requests still need: the measured output rate per model and each request's
remaining tokens. The source of the retry hints of concurrency and in-flight 429s.

A request admitted by the gateway reserves ``max_tokens`` output tokens per choice; while it
streams, the gateway counts the tokens it has received. At a measured per-stream output rate ``r``
(tokens/s) a running request needs about ``(max_tokens - received) / r`` more seconds (an upper
bound: a request that stops at EOS ends sooner). Its lease carries that estimate into Redis
(``gateway/admission.lua``), so a 429 refused for concurrency or in-flight tokens can say when the
blocking request will end instead of quoting the lease TTL.

`OutputRates` keeps ``r`` per model: an exponentially weighted mean (weight `alpha` for the newest)
of the decode rate of finished streams, each measured from its first to its last token (so queueing
and prefill do not count). Only this replica's streams are measured; other replicas measure theirs
and publish their own leases' estimates.
"""

from __future__ import annotations

import threading
from typing import Iterable, Protocol


class StreamProgress(Protocol):
    """What `remaining_s` reads of a request's choice (`gateway.session.Job`)."""

    max_tokens: int
    completion_tokens: int
    first_at: float | None
    last_at: float | None
    first_tokens: int


class OutputRates:
    """Measured decode rate of one stream, in output tokens per second, per model (thread-safe).

    alpha: weight of the newest measurement in the moving mean (the first one is taken as is).
    min_tokens: measurements of fewer tokens after the first are ignored (too noisy).
    """

    def __init__(self, alpha: float = 0.3, min_tokens: int = 4) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.min_tokens = min_tokens
        self._rates: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, model: str, tokens: int, seconds: float) -> None:
        """One stream of `model` produced `tokens` output tokens in `seconds` after its first token."""
        if tokens < self.min_tokens or seconds <= 0:
            return
        r = tokens / seconds
        with self._lock:
            old = self._rates.get(model)
            self._rates[model] = r if old is None else old + self.alpha * (r - old)

    def observe_jobs(self, model: str, jobs: Iterable[StreamProgress]) -> None:
        """Measure every choice of a finished (or ended) request from its first to its last token."""
        for j in jobs:
            if j.first_at is not None and j.last_at is not None:
                self.observe(model, j.completion_tokens - j.first_tokens, j.last_at - j.first_at)

    def rate(self, model: str) -> float | None:
        """Output tokens per second of one stream of `model`, or None before any measurement."""
        return self._rates.get(model)

    def rates(self) -> dict[str, float]:
        """Every model's rate (tokens/s)."""
        with self._lock:
            return dict(self._rates)

    def seconds_for(self, model: str, tokens: int) -> float | None:
        """Seconds one stream of `model` needs for `tokens` output tokens; None while unmeasured."""
        r = self._rates.get(model)
        return None if r is None else max(0, tokens) / r

    def remaining_s(self, model: str, jobs: Iterable[StreamProgress]) -> float | None:
        """Seconds until the slowest choice of a running request has produced all of its
        ``max_tokens`` (its choices run in parallel); None while the model's rate is unmeasured."""
        left = max((j.max_tokens - j.completion_tokens for j in jobs), default=0)
        return self.seconds_for(model, left)


__all__ = ["OutputRates", "StreamProgress"]
