"""Token sampling from last-position logits: greedy, temperature, top-k, top-p (nucleus).

Nucleus sampling: Holtzman et al., "The Curious Case of Neural Text Degeneration", ICLR 2020.
Each request has its own `torch.Generator`, seeded from `SamplingParams.seed` when given, so a
seeded request draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import secrets

import torch

from worker.engine.sequence import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed` (or with fresh randomness when None)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Pick one token per row.

    logits: float tensor [n, vocab] (any device). params / generators: one per row.
    Returns n token ids. Temperature 0 is greedy (argmax; ties to the lowest id).
    """
    logits = logits.float().cpu()
    out: list[int] = []
    for row, p, gen in zip(logits, params, generators):
        if p.temperature <= 0.0:
            out.append(int(torch.argmax(row)))
            continue
        row = row / p.temperature
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
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
