"""`fairshare worker` flags of the radix prefix cache and what they set in `EngineConfig`
(docs/cache-isolation.md).

    --no-prefix-cache            no prefix caching at all (EngineConfig.prefix_cache = False)
    --unsafe-global-cache        EXPERIMENTS ONLY: one namespace for every tenant (cache_isolation =
                                 False), so tenants reuse (and can probe) each other's prompts
    --public-prefix-file PATH    JSON list of public prefixes shared across tenants: strings
                                 (tokenized with the model's tokenizer, no special tokens added) or
                                 lists of token ids
    --ttft-floor TIER=SECONDS    hold a tier's first tokens until SECONDS after arrival (repeatable)
    --cached-rate RATE           fraction of the prompt-token rate charged per cached prompt token

Imports neither torch nor grpc (the tokenizer is passed in).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from worker.scheduling.policy import TIERS

log = logging.getLogger("fairshare.worker")


def _number_in(text: str, lo: float, hi: float, what: str) -> float:
    """Parse a float in [lo, hi]; argparse.ArgumentTypeError names `what` otherwise."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not lo <= x <= hi:
        raise argparse.ArgumentTypeError(f"{what} {x} is not in [{lo:g}, {hi:g}]")
    return x


def _tier_seconds(text: str) -> tuple[str, float]:
    """argparse type for TIER=SECONDS (a known tier, 0 <= seconds <= 600)."""
    tier, sep, value = text.partition("=")
    tier = tier.strip()
    if not sep or tier not in TIERS:
        raise argparse.ArgumentTypeError(f"{text!r} is not TIER=SECONDS (TIER: {', '.join(TIERS)})")
    return tier, _number_in(value, 0, 600, "TTFT floor (seconds)")


def _rate(text: str) -> float:
    """argparse type for a fraction in [0, 1]."""
    return _number_in(text, 0, 1, "cached rate")


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """Add the prefix-cache flags (module docstring) to a parser."""
    g = p.add_argument_group("prefix cache", "tenant-namespaced radix prefix cache (docs/cache-isolation.md)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    g.add_argument("--unsafe-global-cache", action="store_true",
                   help="EXPERIMENTS ONLY: one cache namespace shared by all tenants (leaks prompts across tenants)")
    g.add_argument("--public-prefix-file", default=None, metavar="PATH",
                   help="JSON list of prefixes shared across tenants: strings or lists of token ids")
    add_ttft_floor_argument(g)
    g.add_argument("--cached-rate", type=_rate, default=0.0,
                   help="fraction of the prompt-token rate charged per cached prompt token (default 0)")


def load_public_prefixes(path: str | Path, tokenizer, vocab_size: int | None = None) -> list[list[int]]:
    """Read a JSON list of strings (encoded with `tokenizer`, no special tokens) or token-id lists.
    vocab_size: when given, every token id must be below it (an id the model does not have could
    never match a prompt, so the prefix would silently never be shared).
    Raises ValueError on a malformed file (not a list, an item neither a non-empty string nor a
    non-empty list of ids >= 0, a string that encodes to zero tokens, an id >= vocab_size),
    OSError when it cannot be read."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError("the public prefix file must hold a JSON list")
    out: list[list[int]] = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("string prefixes need a tokenizer")
            ids = list(tokenizer.encode(item, add_special_tokens=False).ids)
            if not ids:
                raise ValueError(f"public prefix #{i} encodes to zero tokens")
            out.append(ids)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                     for t in item):
            if vocab_size is not None and max(item) >= vocab_size:
                raise ValueError(f"public prefix #{i} has token id {max(item)}, not below the model's "
                                 f"vocabulary size {vocab_size}")
            out.append(list(item))
        else:
            raise ValueError(f"public prefix #{i} is neither a string nor a non-empty list of token ids")
    return out


def add_ttft_floor_argument(g) -> None:
    """`--ttft-floor TIER=SECONDS` (repeatable) on a parser or argument group; both workers take it
    (see `ttft_floor_settings`)."""
    g.add_argument("--ttft-floor", type=_tier_seconds, action="append", default=None, metavar="TIER=SECONDS",
                   help="hold the tier's first token until SECONDS after arrival (repeatable)")


def ttft_floor_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, float]:
    """Tier -> TTFT floor in seconds from `--ttft-floor`. Calls `p.error` (exit 2) for a tier given twice."""
    floors: dict[str, float] = {}
    for tier, seconds in args.ttft_floor or []:
        if tier in floors:
            p.error(f"--ttft-floor: tier {tier!r} given twice")
        floors[tier] = seconds
    return floors


def cache_settings(p: argparse.ArgumentParser, args: argparse.Namespace, tokenizer=None,
                   vocab_size: int | None = None) -> dict:
    """EngineConfig fields from the flags. Calls `p.error` (exit 2) for a bad public prefix file
    (see `load_public_prefixes`) or a tier given twice; logs a loud warning for
    --unsafe-global-cache, and a warning for each public prefix shorter than one KV block
    (`args.block_size` tokens, when the parser has it): only whole blocks are shared, so such a
    prefix is never shared."""
    floors = ttft_floor_settings(p, args)
    prefixes: list[list[int]] = []
    if args.public_prefix_file:
        try:
            prefixes = load_public_prefixes(args.public_prefix_file, tokenizer, vocab_size)
        except (OSError, ValueError) as exc:
            p.error(f"--public-prefix-file: {exc}")
        block = getattr(args, "block_size", None)
        for i, ids in enumerate(prefixes):
            if block and len(ids) < block:
                log.warning("public prefix #%d is %d token(s), shorter than one KV block (%d tokens): only whole "
                            "blocks are shared, so it never will be", i, len(ids), block)
    if args.unsafe_global_cache and not args.no_prefix_cache:
        log.warning("UNSAFE: --unsafe-global-cache puts every tenant in ONE prefix-cache namespace; tenants can "
                    "reuse and probe each other's prompts. For experiments only, never in a deployment.")
    return {"prefix_cache": not args.no_prefix_cache, "cache_isolation": not args.unsafe_global_cache,
            "public_prefixes": prefixes, "ttft_floor_s": floors, "cached_rate": args.cached_rate}


__all__ = ["add_cache_arguments", "cache_settings", "load_public_prefixes"]
