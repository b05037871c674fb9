"""Grammar-constrained decoding with xgrammar (structured outputs, forced tool calls).

Algorithm and library: Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine
for Large Language Models", MLSys 2025 (the `xgrammar` package, the engine SGLang and vLLM use). A
grammar is compiled once per distinct source against the model's vocabulary (xgrammar caches compiled
grammars by source); each constrained request then holds a `GrammarMatcher` (a pushdown automaton
over bytes) that yields, before every sampled token, a bitmask of the tokens the grammar allows.

- `GrammarCompiler`: one per engine; builds the xgrammar `TokenizerInfo` from the model's tokenizer
  on first use (about 2 s for a 49k vocabulary; callers run it off the engine loop) and compiles a
  `(kind, source)` pair: ``json_schema`` (JSON Schema text), ``json_object`` (any JSON object),
  ``regex``, ``ebnf`` or ``structural_tag`` (xgrammar's structural-tag JSON). JSON is generated
  compactly (no free whitespace between tokens: a model cannot pad its output forever).
  Raises `InvalidGrammar` (a ValueError) for a source it cannot compile.
- JSON grammars (json_schema, json_object, and structural tags, whose contents are JSON) also mask
  every token holding a control character other than a newline (U+0000-U+001F but LF): JSON text
  never contains one raw (RFC 8259, section 7, for strings; compact JSON has no other whitespace than
  spaces, and newlines only in a structural tag's own delimiters), and xgrammar 0.2's rule for
  length-bounded strings (``maxLength``) lets them through, which made such output unparseable.
- `Constraint`: one request's matcher: `accept(token)` after each committed token, `terminated`
  once the grammar accepted an end-of-sequence token.
- `apply_masks(logits, constraints)`: masks, in place, the rows of a batch whose request is
  constrained (disallowed tokens get -inf); unconstrained rows are untouched, so constrained and
  free requests share one iteration.

Imports torch and xgrammar (worker side only; the gateway never imports this module).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict

import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
JSON_KINDS = ("json_schema", "json_object", "structural_tag")
_CONTROL_BYTES = frozenset(range(0x20)) - {0x0A}  # never raw in JSON output (LF: a tag's delimiters)
_XGR_LOCATION = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")
CHECKED_SOURCES = 4096  # digests of sources that passed the satisfiability checks, kept (most recent)


class InvalidGrammar(ValueError):
    """The grammar (a JSON schema, regex, EBNF or structural tag) cannot be compiled."""


def _clean(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source location."""
    text = " ".join(_CHECK_FAILED.sub("", _XGR_LOCATION.sub("", str(exc))).split())
    return text or type(exc).__name__


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary.

    tokenizer: a `tokenizers.Tokenizer`. vocab_size: rows of the model's logits (may exceed the
    tokenizer's vocabulary). stop_token_ids: end-of-sequence ids the grammar allows once complete.
    cache_mb: memory xgrammar may keep for compiled grammars (MiB). Thread-safe.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *, cache_mb: int = 256,
                 threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._cache_bytes = int(cache_mb) * 2**20
        self._threads = threads
        self._compiler = None
        self._json_mask: torch.Tensor | None = None
        self._lock = threading.Lock()
        # sha256 of (kind, source) that passed every check: a request repeating a grammar (the same
        # tools, the same schema) skips the checks, ~25 us a schema, as xgrammar skips the compile
        self._checked: OrderedDict[bytes, None] = OrderedDict()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=True,
                                                     cache_limit_bytes=self._cache_bytes)
                self._json_mask = _bitmask_without(info.decoded_vocab, self.vocab_size, _CONTROL_BYTES,
                                                   set(self.stop_token_ids))
            return self._compiler

    def compile(self, kind: str, source: str = "") -> "CompiledConstraint":
        """The compiled grammar of `(kind, source)` (xgrammar caches compilations by source).

        Raises InvalidGrammar for an unknown kind, a source that does not compile (not JSON, an
        unsupported or malformed JSON Schema, a bad regex / EBNF / structural tag), or one that
        compiles but allows no first token (nothing can be generated under it)."""
        if kind not in KINDS:
            raise InvalidGrammar(f"unknown grammar kind {kind!r}")
        compiled = self._compile(kind, source)
        constraint = CompiledConstraint(compiled, self._json_mask if kind in JSON_KINDS else None)
        key = hashlib.sha256(f"{kind}\0{source}".encode()).digest()
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return constraint
        if not Constraint(constraint).allows_any():
            # e.g. the schema {"$ref": "#"}: it compiles, and no token can start an output of it
            raise InvalidGrammar(f"invalid {kind}: no output satisfies it (the grammar allows no first token)")
        if kind == "structural_tag":
            self._check_embedded_schemas(source)
        with self._lock:
            self._checked[key] = None
            while len(self._checked) > CHECKED_SOURCES:
                self._checked.popitem(last=False)
        return constraint

    def _check_embedded_schemas(self, source: str) -> None:
        """Each JSON schema inside a structural tag (a tool's parameters, the answer's schema) must
        admit a value: the tag as a whole may still allow a first token (a tool call's fixed
        opening) and then reach a dead end inside it, e.g. a tool whose parameters are
        ``{"$ref": "#"}``. Raises InvalidGrammar naming the schema by the text before it."""
        for schema, where in _embedded_schemas(json.loads(source), ""):
            try:
                self.compile("json_schema", json.dumps(schema))
            except InvalidGrammar as exc:
                raise InvalidGrammar(f"invalid structural_tag: the JSON schema {where}: "
                                     f"{str(exc).removeprefix('invalid json_schema: ')}") from None

    def _compile(self, kind: str, source: str):
        compiler = self._get()
        try:
            if kind == "json_schema":
                json.loads(source)  # a clear message for text that is not JSON at all
                return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "ebnf":
                return compiler.compile_grammar(source)
            return compiler.compile_structural_tag(source)
        except ValueError as exc:  # json.JSONDecodeError, pydantic's ValidationError, xgrammar's own
            raise InvalidGrammar(f"invalid {kind}: {_clean(exc)}") from None
        except Exception as exc:  # xgrammar raises RuntimeError (and its own types) from C++
            raise InvalidGrammar(f"invalid {kind}: {_clean(exc)}") from None


def _embedded_schemas(node, begin: str):
    """(schema, where) for every ``{"type": "json_schema", "json_schema": S}`` element in a structural
    tag's JSON, `where` naming it by the fixed text of the tag it is the content of (for a tool
    call, its opening with the function's name)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield node["json_schema"], (f"after {begin!r}" if begin else "of the answer")
            return
        tag_begin = node.get("begin") if node.get("type") == "tag" and isinstance(node.get("begin"), str) else begin
        for key, value in node.items():
            yield from _embedded_schemas(value, tag_begin if key == "content" else begin)
    elif isinstance(node, list):
        for value in node:
            yield from _embedded_schemas(value, begin)


def _bitmask_without(vocab: list[bytes], vocab_size: int, banned: frozenset[int], keep: set[int]) -> torch.Tensor:
    """An xgrammar-layout token bitmask [ceil(vocab_size / 32)] int32 allowing every token whose bytes
    contain none of `banned` (and every token in `keep`); ids past `vocab` are disallowed."""
    flags = [i in keep or banned.isdisjoint(b) for i, b in enumerate(vocab[:vocab_size])]
    allowed = torch.zeros(((vocab_size + 31) // 32) * 32, dtype=torch.bool)
    allowed[:len(flags)] = torch.tensor(flags, dtype=torch.bool)
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
    words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class CompiledConstraint:
    """A compiled grammar (xgrammar `CompiledGrammar`) plus the static token mask it is combined
    with (JSON grammars: no raw control characters; None for the others). What
    `SamplingParams.grammar` holds."""

    def __init__(self, compiled, static_mask: torch.Tensor | None) -> None:
        self.compiled = compiled
        self.static_mask = static_mask


class Constraint:
    """One request's grammar state over a `CompiledConstraint` (an xgrammar `GrammarMatcher`)."""

    def __init__(self, grammar: CompiledConstraint) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.static_mask = grammar.static_mask
        self.vocab_size = int(grammar.compiled.tokenizer_info.vocab_size)

    def accept(self, token: int) -> bool:
        """Advance past a committed token; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and accepted an end-of-sequence token."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bitmask of the next position into `bitmask[row]`."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.static_mask is not None:
            bitmask[row, :self.static_mask.numel()] &= self.static_mask

    def allows_any(self) -> bool:
        """Whether some token is allowed at the next position (the static mask included)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill(bitmask, 0)
        return bool(bitmask.any())


_BITMASKS: dict[tuple[int, int], torch.Tensor] = {}  # (rows, vocab) -> reusable bitmask (engine thread)


def no_allowed_token(logits: torch.Tensor, constraints: list["Constraint | None"]) -> list[int]:
    """Rows of masked `logits` [n, vocab] (from `apply_masks`) whose constraint allows no token at all
    (every logit -inf): a grammar at a dead end. Sampling such a row has no answer (softmax of
    all -inf is NaN), so the engine ends that request alone instead of failing its batch. One row-wise
    max over the batch (about 14 us for 8 rows of 49k; a per-row `isfinite` was 72 us a row)."""
    top = logits.amax(dim=1).tolist()
    return [i for i, c in enumerate(constraints) if c is not None and top[i] == -math.inf]


def apply_masks(logits: torch.Tensor, constraints: list["Constraint | None"]) -> torch.Tensor:
    """Mask `logits` [n, vocab] for the rows whose constraint is set; returns the tensor to sample
    from (float32 on the CPU, masked in place; disallowed tokens are -inf)."""
    import xgrammar as xgr

    rows = [i for i, c in enumerate(constraints) if c is not None]
    logits = logits.float().cpu()
    if not rows:
        return logits
    n, vocab = logits.shape
    key = (n, vocab)
    bitmask = _BITMASKS.get(key)
    if bitmask is None:
        if len(_BITMASKS) > 64:
            _BITMASKS.clear()
        bitmask = _BITMASKS[key] = xgr.allocate_token_bitmask(n, vocab)
    for i in rows:
        constraints[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
    return logits
