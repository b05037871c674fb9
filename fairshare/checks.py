"""Argument checks every layer shares: one wording for "this size must be at least N".

Constructors of the scheduling core, the KV ledger, the block manager, the model runner and the
simulator all take sizes (blocks, tokens, running slots) that must be positive or non-negative; they
call `require_at_least` instead of each writing its own test and message.
"""

from __future__ import annotations


def require_at_least(minimum: float, **values: float | None) -> None:
    """Raise ValueError naming every one of `values` (name=value) that is below `minimum`.

    None means "not set" and is not checked. ``require_at_least(1, max_running=0, block_size=16)``
    raises ``ValueError("max_running must be >= 1 (got 0)")``; several offenders are listed in one
    message, separated by "; ".
    """
    bad = [f"{name} must be >= {minimum:g} (got {value!r})" for name, value in values.items()
           if value is not None and value < minimum]
    if bad:
        raise ValueError("; ".join(bad))
