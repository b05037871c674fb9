"""Log probabilities in OpenAI's shapes, from the token ids and logprobs the worker sends.

The worker sends, per committed token, ``(token_id, logprob, top: [(token_id, logprob)])``
(proto ``TokenLogprob``; worker/engine/sampler.py says which distribution). The gateway turns ids
into what OpenAI shows:

- ``token``: the token's text. A token that is only part of a UTF-8 character (byte-level BPE splits
  multi-byte characters) is shown as ``bytes:\\xe4\\xbd`` (its bytes escaped), as OpenAI does.
- ``bytes``: the token's UTF-8 bytes as a list of ints. Concatenated over a response they are the
  bytes of its text (tokens that end generation, EOS and stop token ids, are left out: they are not
  part of the text).

Shapes: chat ``choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
logprob, bytes}]}], "refusal": null}``; completions ``choices[].logprobs = {tokens, token_logprobs,
top_logprobs: [{token: logprob}], text_offset}`` where the top map also holds the sampled token (so up
to ``logprobs + 1`` entries, as OpenAI documents) and ``text_offset`` is each token's character
offset in the choice's text (counting each token's ``token`` string).
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes-to-unicode table (byte-level BPE vocabularies spell bytes with it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def _decoder_types(node: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            out.add(node["type"])
        for v in node.values():
            out |= _decoder_types(v)
    elif isinstance(node, list):
        for v in node:
            out |= _decoder_types(v)
    return out


class TokenTexts:
    """Bytes and display strings of one tokenizer's tokens (cached per id).

    tokenizer: a `tokenizers.Tokenizer`. Byte-level BPE (GPT-2, Llama-3, Qwen, SmolLM) and
    SentencePiece-style vocabularies (``▁`` for a space, ``<0xNN>`` byte fallback) are decoded exactly;
    others through the tokenizer's own decoder.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        spec = json.loads(tokenizer.to_str())
        types = _decoder_types(spec.get("decoder"))
        self._byte_level = "ByteLevel" in types
        self._metaspace = bool({"Metaspace", "Replace"} & types) or "ByteFallback" in types
        self._added = {int(t["id"]): t["content"] for t in spec.get("added_tokens", []) if "id" in t}
        self._bytes = _byte_level_decoder() if self._byte_level else {}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for."""
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._compute(token_id)
            if len(self._cache) > 200_000:
                self._cache.clear()
        return b

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece)
        if self._metaspace:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("▁", " ").encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_of(self, token_id: int) -> str:
        """OpenAI's ``token`` string: the text, or ``bytes:\\xNN...`` for part of a character."""
        b = self.bytes_of(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def item(self, token_id: int, logprob: float) -> dict[str, Any]:
        """``{token, logprob, bytes}``."""
        return {"token": self.token_of(token_id), "logprob": finite(logprob), "bytes": list(self.bytes_of(token_id))}


def finite(logprob: float) -> float:
    """A logprob JSON can carry: a token of probability 0 (-inf; workers leave such alternatives out,
    worker/engine/sampler.py) is shown as OpenAI shows one, -9999.0."""
    v = float(logprob)
    return v if math.isfinite(v) else -9999.0


def _alternatives(e) -> list:
    """The entry's alternatives of non-zero probability (a backend may send masked ones as -inf)."""
    return [t for t in e.top if t.logprob > -math.inf]


def chat_content(texts: TokenTexts, entries: Iterable, skip: set[int]) -> list[dict[str, Any]]:
    """``logprobs.content`` items of chat completions for proto `TokenLogprob` entries (tokens in
    `skip`, EOS and stop ids, left out)."""
    out = []
    for e in entries:
        if e.token_id in skip:
            continue
        item = texts.item(e.token_id, e.logprob)
        item["top_logprobs"] = [texts.item(t.token_id, t.logprob) for t in _alternatives(e)]
        out.append(item)
    return out


class CompletionLogprobs:
    """Accumulates the ``logprobs`` object of one text-completion choice (``text_offset`` runs on
    across streamed chunks)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0

    def add(self, entries: Iterable, skip: set[int]) -> dict[str, Any]:
        """The ``logprobs`` object for these entries (a chunk's, or all of a choice's)."""
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            if e.token_id in skip:
                continue
            tok = self.texts.token_of(e.token_id)
            top = {self.texts.token_of(t.token_id): finite(t.logprob) for t in _alternatives(e)}
            top.setdefault(tok, finite(e.logprob))
            tokens.append(tok)
            lps.append(finite(e.logprob))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


__all__ = ["CompletionLogprobs", "TokenTexts", "chat_content"]
