"""Service cost: what one unit of GPU work is charged in *service units*.

Source: Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), section 4.1:
the service a client receives is a weighted count of the tokens processed for it,
`c = α·P + β·O` with `P` prompt (input) tokens computed and `O` output tokens generated; the paper
uses α = 1, β = 2 (output tokens cost more because decode is memory-bound).

FairShare charges as work is done: each prefill chunk when it is computed, each decode token when
it is committed. Prompt tokens served from the prefix cache are charged at `cached_rate · α`
(default 0: a cache hit costs no compute). Cancelled or failed requests keep what they consumed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearCost:
    """Linear service cost `α·P + β·O` (VTC paper, §4.1, eq. for h(n_p, n_q) in its linear form).

    alpha: service units per computed prompt token (> 0).
    beta: service units per committed output token (> 0).
    cached_rate: fraction of `alpha` charged per prompt token taken from the prefix cache, in [0, 1].

    Raises ValueError on negative or zero rates.
    """

    alpha: float = 1.0
    beta: float = 2.0
    cached_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha <= 0 or self.beta <= 0:
            raise ValueError(f"cost rates must be > 0 (alpha={self.alpha}, beta={self.beta})")
        if not 0.0 <= self.cached_rate <= 1.0:
            raise ValueError(f"cached_rate must be within [0, 1], got {self.cached_rate}")

    def prefill(self, computed_tokens: int, cached_tokens: int = 0) -> float:
        """Service units for a prefill chunk: `α·computed + cached_rate·α·cached` (tokens → units)."""
        return self.alpha * computed_tokens + self.cached_rate * self.alpha * cached_tokens

    def decode(self, output_tokens: int = 1) -> float:
        """Service units for committed output tokens: `β·output_tokens`."""
        return self.beta * output_tokens

    def describe(self) -> str:
        """One line stating the cost function, printed by every report."""
        return f"linear: c = {self.alpha:g}*P + {self.beta:g}*O (cached prompt tokens at {self.cached_rate:g}*alpha)"
