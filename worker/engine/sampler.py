"""Token sampling from last-position logits: greedy, temperature, top-k, top-p (nucleus), logprobs.

Nucleus sampling: Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020.
Each request has its own `torch.Generator`, seeded from `SamplingParams.seed` when given, so a
seeded request draws the same tokens whatever else shares its batch.

Log probabilities (OpenAI ``logprobs`` / ``top_logprobs``) come from the same logits the token is
drawn from: the model's logits after the grammar mask (worker/engine/grammar.py; masked tokens have
probability 0), divided by the temperature (temperature 0, greedy, counts as 1), log-softmaxed over
the whole vocabulary, before top-k / top-p truncation. That is the distribution the temperature
defines (OpenAI's and SGLang's choice); truncation only narrows which of its tokens may be drawn,
and taking logprobs after it would give every alternative outside the nucleus -inf.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from worker.engine.sequence import SamplingParams


@dataclass
class Sample:
    """One sampled token. logprob: its log probability (natural log; None unless the request asked
    for logprobs). top: the `top_logprobs` most likely (token id, logprob) pairs, most likely first."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed` (or with fresh randomness when None)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def token_logprobs(row: torch.Tensor, temperature: float, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of `token`, up to `top` most likely (id, logprob)) of one row of logits [vocab] at
    `temperature` (<= 0 counts as 1). Ties in the top list go to the lowest id. Tokens of
    probability 0 (masked by a grammar: logprob -inf) are no alternatives and are left out, so under
    a grammar that allows fewer than `top` tokens the list is shorter (and JSON has no -inf)."""
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(row / t if t != 1.0 else row, dim=-1)
    alts: list[tuple[int, float]] = []
    if top > 0:
        vals, ids = torch.topk(lp, min(top, lp.numel()))
        alts = [(int(i), v) for v, i in zip(vals.tolist(), ids.tolist()) if v > -math.inf]
    return float(lp[token]), alts


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[Sample]:
    """Pick one token per row.

    logits: float tensor [n, vocab] (any device; grammar masks already applied). params /
    generators: one per row. Returns n `Sample`s (with logprobs for rows whose params ask for them).
    Temperature 0 is greedy (argmax; ties to the lowest id).
    """
    logits = logits.float().cpu()
    out: list[Sample] = []
    for raw, p, gen in zip(logits, params, generators):
        if p.temperature <= 0.0:
            tok = int(torch.argmax(raw))
        else:
            row = raw / p.temperature
            if p.top_k and p.top_k > 0 and p.top_k < row.numel():
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, idx = torch.sort(probs, descending=True)
                cum = torch.cumsum(sorted_probs, dim=-1)
                drop = cum - sorted_probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
            tok = int(torch.multinomial(probs, 1, generator=gen))
        if p.logprobs:
            lp, top = token_logprobs(raw, p.temperature, tok, p.top_logprobs)
            out.append(Sample(tok, lp, top))
        else:
            out.append(Sample(tok))
    return out
