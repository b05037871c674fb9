"""Service cost: what one unit of GPU work is charged, in *service units*.

Source: Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024), §4.1 (the service a
client receives is a cost function of the input and output tokens processed for it) and §5.4/§6
(a cost function profiled from measured prefill/decode times as an alternative to the linear one).

Two cost functions, both charged *as work is done* (DESIGN.md, "Service unit"):

- `LinearCost`: `c(P, O) = α·P + β·O` service units, `P` prompt tokens computed, `O` output tokens
  committed (defaults α = 1, β = 2, as in the paper). Prompt tokens served from the prefix cache are
  charged `cached_rate·α` each.
- `ProfiledCost`: `h(P, O) = a·P + b·O + c·P·O + d·O² + e` (the paper's profiled quadratic form),
  charged incrementally so that a request that completes is charged exactly `h(P, O)`: a prefill
  chunk of `n` tokens costs `a·n` (plus the constant `e` on the request's first chunk), the k-th
  output token costs `h(P, k) − h(P, k−1) = b + c·P + d·(2k − 1)`.

Each prefill chunk is charged when it is computed and each output token when it is committed, so a
cancelled or failed request keeps exactly what it consumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class LinearCost:
    """Linear service cost `α·P + β·O` (VTC paper §4.1, the linear form of h(n_p, n_q)).

    alpha: service units per computed prompt token (> 0).
    beta: service units per committed output token (> 0).
    cached_rate: fraction of `alpha` charged per prompt token taken from the prefix cache, in [0, 1].

    Raises ValueError on non-positive rates or a cached_rate outside [0, 1].
    """

    alpha: float = 1.0
    beta: float = 2.0
    cached_rate: float = 0.0

    name = "linear"

    def __post_init__(self) -> None:
        if self.alpha <= 0 or self.beta <= 0:
            raise ValueError(f"cost rates must be > 0 (alpha={self.alpha}, beta={self.beta})")
        if not 0.0 <= self.cached_rate <= 1.0:
            raise ValueError(f"cached_rate must be within [0, 1], got {self.cached_rate}")

    def prefill(self, computed_tokens: int, cached_tokens: int = 0, start: int = 0) -> float:
        """Units for a prefill chunk: `α·computed + cached_rate·α·cached`. `start` (tokens already
        charged for this request) is accepted for interface parity with `ProfiledCost`."""
        return self.alpha * computed_tokens + self.cached_rate * self.alpha * cached_tokens

    def decode(self, output_tokens: int = 1, prompt_tokens: int = 0, prior_output: int = 0) -> float:
        """Units for `output_tokens` committed output tokens: `β·output_tokens` (the other two
        arguments are used by `ProfiledCost` only)."""
        return self.beta * output_tokens

    def request(self, prompt_tokens: int, output_tokens: int) -> float:
        """Units a whole request costs (used for offered demand): `α·P + β·O`."""
        return self.alpha * prompt_tokens + self.beta * output_tokens

    @property
    def max_prefill_rate(self) -> float:
        """Most units one prompt token can cost (α): used by the fairness bound."""
        return self.alpha

    def max_decode_rate(self, max_context: int) -> float:
        """Most units one output token can cost (β)."""
        return self.beta

    def describe(self) -> str:
        """One line stating the cost function, printed by every report."""
        return f"linear: c = {self.alpha:g}*P + {self.beta:g}*O (cached prompt tokens at {self.cached_rate:g}*alpha)"


class QuadraticFit(NamedTuple):
    """The coefficients of `h(P, O) = a·P + b·O + c·P·O + d·O² + e` (service units; P prompt
    tokens, O output tokens): fitted to measured prefill and decode times on the serving hardware,
    so that one unit ≈ one unit of GPU time. A plain 5-tuple `(a, b, c, d, e)` converts with
    `QuadraticFit(*t)`."""

    a: float
    b: float
    c: float
    d: float
    e: float


# The VTC paper's published fit (milliseconds on an A10G with Llama-7B): useful as a shape. Nothing
# in this repository fits one (`fairshare sim calibrate` fits the simulator's iteration time model).
VTC_PAPER_FIT = QuadraticFit(a=0.21001891, b=0.10075395, c=0.0039868, d=0.00324733, e=1.14601454)


@dataclass(frozen=True)
class ProfiledCost:
    """Profiled quadratic cost `h(P, O) = a·P + b·O + c·P·O + d·O² + e` in service units
    (VTC paper, the profiled cost function of its evaluation).

    fit: the coefficients (`QuadraticFit`, or any 5-sequence (a, b, c, d, e); default the paper's,
    `VTC_PAPER_FIT`). cached_rate: fraction of `a` charged per cached prompt token. Raises
    ValueError on a fit that is not five numbers, negative coefficients or a non-positive `a` / `b`.
    """

    fit: QuadraticFit = VTC_PAPER_FIT
    cached_rate: float = 0.0

    name = "profiled"

    def __post_init__(self) -> None:
        try:
            fit = QuadraticFit(*map(float, self.fit))
        except (TypeError, ValueError):
            raise ValueError(f"profiled cost needs five coefficients (a, b, c, d, e), got {self.fit!r}") from None
        object.__setattr__(self, "fit", fit)
        if fit.a <= 0 or fit.b <= 0 or min(fit.c, fit.d, fit.e) < 0:
            raise ValueError("profiled cost needs a, b > 0 and c, d, e >= 0")
        if not 0.0 <= self.cached_rate <= 1.0:
            raise ValueError(f"cached_rate must be within [0, 1], got {self.cached_rate}")

    def h(self, prompt_tokens: int, output_tokens: int) -> float:
        """The cost of a whole request: `h(P, O)`."""
        a, b, c, d, e = self.fit
        p, o = prompt_tokens, output_tokens
        return a * p + b * o + c * p * o + d * o * o + e

    def prefill(self, computed_tokens: int, cached_tokens: int = 0, start: int = 0) -> float:
        """Units for a prefill chunk: `a·computed + cached_rate·a·cached`, plus `e` when the chunk
        is the request's first (`start == 0`)."""
        a, e = self.fit.a, self.fit.e
        units = a * computed_tokens + self.cached_rate * a * cached_tokens
        return units + (e if start == 0 and (computed_tokens or cached_tokens) else 0.0)

    def decode(self, output_tokens: int = 1, prompt_tokens: int = 0, prior_output: int = 0) -> float:
        """Units for output tokens `prior_output+1 … prior_output+output_tokens` of a request with
        `prompt_tokens` prompt tokens: `h(P, O1) − h(P, O0)`."""
        _, b, c, d, _ = self.fit
        o0, o1 = prior_output, prior_output + output_tokens
        return b * output_tokens + c * prompt_tokens * output_tokens + d * (o1 * o1 - o0 * o0)

    def request(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.h(prompt_tokens, output_tokens)

    @property
    def max_prefill_rate(self) -> float:
        return self.fit.a

    def max_decode_rate(self, max_context: int) -> float:
        """Most units one output token can cost in a context of `max_context` tokens."""
        return self.fit.b + (self.fit.c + 2 * self.fit.d) * max_context

    def describe(self) -> str:
        a, b, c, d, e = self.fit
        return (f"profiled: h(P, O) = {a:g}*P + {b:g}*O + {c:g}*P*O + {d:g}*O^2 + {e:g} "
                f"(cached prompt tokens at {self.cached_rate:g}*a)")


CostFunction = LinearCost | ProfiledCost


def make_cost(name: str = "linear", *, alpha: float = 1.0, beta: float = 2.0, cached_rate: float = 0.0,
              profile: QuadraticFit | None = None) -> CostFunction:
    """Build a cost function by name: `linear` (alpha, beta) or `profiled` (profile: its
    `QuadraticFit` or a 5-tuple (a, b, c, d, e); None: `VTC_PAPER_FIT`). Raises ValueError for an
    unknown name or bad coefficients."""
    if name == "linear":
        return LinearCost(alpha, beta, cached_rate)
    if name == "profiled":
        return ProfiledCost(VTC_PAPER_FIT if profile is None else profile, cached_rate)
    raise ValueError(f"unknown cost function {name!r}; choose 'linear' or 'profiled'")
