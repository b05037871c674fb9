"""Incremental detokenization that never emits a broken multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 character (CJK, emoji); decoding such a
prefix yields U+FFFD. The detokenizer keeps two offsets into the token list (the technique vLLM
and TGI use): it decodes a short window, and only emits the new text once the window decodes
without a trailing replacement character. A few prompt tokens seed the window so that tokenizers
which drop a leading space at the start of a decode still produce the right first delta.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns committed token ids into text deltas.

    tokenizer: a `tokenizers.Tokenizer`. prompt_token_ids: the prompt (its last few tokens seed the
    decode window). skip_token_ids: ids never rendered (e.g. EOS / stop token ids).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_token_ids: set[int] | None = None,
                 window: int = 5) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_token_ids or set()
        self.ids: list[int] = list(prompt_token_ids[-window:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one committed token; return the new complete text (possibly empty)."""
        if token_id in self.skip:
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever text is still held back (may hold U+FFFD only if the
        model emitted bytes that are not valid UTF-8)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


def stop_string_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    That many trailing characters must be held back: they might become a stop string.
    """
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
