"""Tokenizing in the gateway (HF `tokenizers` + the model's Jinja chat template; no torch, no model files).

The tokenizer (``tokenizer.json`` text) and chat template come from the worker (``GetModelInfo``) or
from a local directory (``--tokenizer DIR``). The template is rendered the way Hugging Face's
``apply_chat_template`` does it: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag, the ``tojson`` filter
without HTML escaping, ``raise_exception`` and ``strftime_now``; variables ``messages``,
``add_generation_prompt=True``, ``bos_token`` and ``eos_token``, and ``tools`` (the request's tools as
OpenAI dicts) for templates that use it; past calls' ``arguments`` are given to such templates as
objects, as HF's convention is. Templates without a ``tools`` variable get the tool-call parser's
fallback rendering instead (gateway/tools.py). The rendered text is encoded without adding special
tokens (the template already holds them); raw completion prompts are encoded with them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """The chat template refused the conversation (e.g. ``raise_exception`` in the template)."""


class PromptTooLong(ValueError):
    """A prompt has more than the allowed tokens, known without encoding it: ``at_least`` tokens
    (`ChatTokenizer.min_tokens`) against ``limit``."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"at least {at_least} tokens, over {limit}")
        self.at_least, self.limit = at_least, limit


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):  # noqa: D102
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template_env() -> ImmutableSandboxedEnvironment:
    """The sandboxed Jinja environment chat templates are compiled in (HF ``apply_chat_template``'s)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like HF ``apply_chat_template``.

    Raises jinja2.TemplateSyntaxError for a template that does not parse.
    """
    return compile_chat_template_env().from_string(source)


def tokenizer_sha256(tokenizer_json: str, chat_template: str) -> str:
    """sha256 hex of ``tokenizer_json + chat_template`` (UTF-8), as the worker reports in ModelInfo."""
    return hashlib.sha256((tokenizer_json + chat_template).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TokenizerFiles:
    """The texts a gateway needs to tokenize for one model."""

    tokenizer_json: str
    chat_template: str
    bos_token: str = ""
    eos_token: str = ""

    @functools.cached_property
    def sha256(self) -> str:
        """sha256 of tokenizer_json + chat_template (computed once: a tokenizer JSON is megabytes, and
        every response names it in ``system_fingerprint``)."""
        return tokenizer_sha256(self.tokenizer_json, self.chat_template)

    def sha256_variants(self) -> set[str]:
        """Digests a worker may report: of ``json + template`` (the proto's wording) or ``json + NUL +
        template`` (what the reference worker computes)."""
        return {self.sha256, tokenizer_sha256(self.tokenizer_json + "\0", self.chat_template)}


def _token_text(v: Any) -> str:
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return "" if v is None else str(v)


def load_tokenizer_dir(path: str | Path) -> TokenizerFiles:
    """Read ``tokenizer.json`` and the chat template from a HF model directory (no weights needed).

    The template comes from ``chat_template.jinja`` or ``tokenizer_config.json["chat_template"]``
    (for a list of named templates, the one named ``default``). Raises FileNotFoundError.
    """
    p = Path(path)
    if p.is_file():
        p = p.parent
    tokenizer_json = (p / "tokenizer.json").read_text(encoding="utf-8")
    cfg: dict[str, Any] = {}
    if (p / "tokenizer_config.json").exists():
        cfg = json.loads((p / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = ""
    if (p / "chat_template.jinja").exists():
        template = (p / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        t = cfg.get("chat_template") or ""
        if isinstance(t, list):
            named = {d.get("name"): d.get("template", "") for d in t if isinstance(d, dict)}
            t = named.get("default") or next(iter(named.values()), "")
        template = t
    return TokenizerFiles(tokenizer_json, template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its tool calls' ``arguments`` parsed from JSON text into objects (what chat
    templates that render tool calls expect); arguments that are not JSON stay text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        out.append({**c, "function": fn})
    return {**message, "tool_calls": out}


class ChatTokenizer:
    """Counts and encodes prompts for one model.

    Raises TemplateError from `render_chat` when the template rejects the messages or the model has
    no chat template.
    """

    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        self.tokenizer = Tokenizer.from_str(files.tokenizer_json)
        self._template = compile_chat_template(files.chat_template) if files.chat_template else None
        self.supports_tools = bool(files.chat_template) and "tools" in jinja2.meta.find_undeclared_variables(
            compile_chat_template_env().parse(files.chat_template))

    @property
    def sha256(self) -> str:
        """sha256 of the tokenizer json + chat template this tokenizer was built from."""
        return self.files.sha256

    def normalized(self) -> str:
        """A canonical form (re-serialised tokenizer + template) to compare tokenizers whose JSON text differs."""
        return self.tokenizer.to_str() + "\0" + self.files.chat_template

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    parser=None) -> str:
        """The prompt text for `messages` with the generation prompt appended. tools: the request's
        tools (OpenAI dicts). parser: the model's `gateway.tools.ToolCallParser`, which renders tools,
        past calls and tool results when the template has no ``tools`` variable."""
        if self._template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        extra: dict[str, Any] = {}
        has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if self.supports_tools:
            messages = [_with_object_arguments(m) for m in messages] if has_tool_turns else messages
            if tools:
                extra["tools"] = tools
        elif (tools or has_tool_turns) and parser is not None:
            from .tools import fallback_messages

            messages = fallback_messages(messages, tools, parser)
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.files.bos_token, eos_token=self.files.eos_token, **extra)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(str(e)) from e

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    parser=None, limit: int | None = None) -> list[int]:
        """Token ids of the rendered conversation (special tokens come from the template only);
        `tools` / `parser` as in `render_chat`. Raises PromptTooLong, before encoding, when the
        rendered text is sure to exceed `limit` tokens (None: no limit)."""
        return self._encode(self.render_chat(messages, tools, parser), add_special_tokens=False, limit=limit)

    def encode_text(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of a raw completion prompt, with the tokenizer's special tokens (e.g. BOS).
        Raises PromptTooLong as `encode_chat`."""
        return self._encode(text, add_special_tokens=True, limit=limit)

    def _encode(self, text: str, add_special_tokens: bool, limit: int | None = None) -> list[int]:
        """Token ids of `text`, computed without holding the GIL.

        `Tokenizer.encode` keeps the GIL for the whole encoding (seconds for a prompt of megabytes),
        so a thread running it (the gateway tokenizes large bodies with `asyncio.to_thread`) would
        still stop the event loop, and with it every other tenant's streams. `encode_batch` releases
        the GIL while it works and gives the same ids; a batch of one costs the same CPU.
        A text sure to exceed `limit` tokens (`min_tokens`) raises PromptTooLong instead.
        """
        # a text of at most `limit` characters (at most 4·limit bytes) has a bound of at most `limit`
        # once a token may stand for 4 bytes or more, as in any real vocabulary: nearly every prompt
        # is encoded without the check (and without reading the vocabulary for max_token_bytes)
        if limit is not None and len(text) > limit and (at_least := self.min_tokens(text)) > limit:
            raise PromptTooLong(at_least, limit)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(_encode(text))`` (tokens) from the text's UTF-8 length alone, so a
        prompt far over the context is refused without seconds of tokenizing it.

        Each token stands for at most `max_token_bytes` bytes of the text it encodes (a byte-level
        BPE token's string is its bytes; a SentencePiece ``▁`` or a ``<0x..>`` byte token is longer
        than what it covers, added tokens count their content), so ``ceil(bytes / max_token_bytes)``
        tokens at least. Sound only when nothing shortens the text before it is split: 0 (no bound)
        when the tokenizer has a normalizer. A byte-level BPE without an unknown token drops the bytes
        its vocabulary has no symbol for (SmolLM2 lacks 21 of the 256, e.g. ``\x16``, which encodes
        to no token at all): those bytes are not counted (`dropped_bytes`); a tokenizer of another kind
        that may drop characters unseen (no unknown token, no byte fallback) gets no bound.
        """
        dropped = self.dropped_bytes
        if dropped is None:
            return 0
        data = text.encode("utf-8", "surrogatepass")
        size = len(data.translate(None, dropped) if dropped else data)
        return -(-size // self.max_token_bytes)

    @functools.cached_property
    def dropped_bytes(self) -> bytes | None:
        """The byte values the tokenizer drops without a token (b"": none), or None when it may shorten
        or drop text in ways not listed here (a normalizer; a model other than byte-level that has no
        unknown token and no byte fallback): `min_tokens` then gives no bound."""
        if self.tokenizer.normalizer is not None:
            return None
        model = self.tokenizer.model
        if getattr(model, "unk_token", None) or getattr(model, "byte_fallback", False):
            return b""  # an unknown character becomes a token of its own
        if "ByteLevel(" not in repr(self.tokenizer.pre_tokenizer):
            return None
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        return bytes(b for b, ch in enumerate(_byte_level_alphabet()) if ch not in vocab)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """How many bytes of text one token can stand for at most (>= 1): the longest token string in
        the vocabulary, added tokens included. Under a byte-level pre-tokenizer (GPT-2's ``Ġ`` alphabet)
        each character of a vocabulary token is one byte of text; otherwise a token string's UTF-8
        length bounds what it covers."""
        byte_level = "ByteLevel(" in repr(self.tokenizer.pre_tokenizer)  # alone or inside a Sequence
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}

        def covers(token: str) -> int:
            return len(token) if byte_level and token not in added else len(token.encode("utf-8", "surrogatepass"))

        return max(map(covers, self.tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (including added tokens)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


@functools.cache
def _byte_level_alphabet() -> tuple[str, ...]:
    """The character GPT-2's byte-level pre-tokenizer maps each byte value (0-255) to: printable
    Latin-1 bytes to themselves, the other 68 to U+0100 onwards in byte order (the `tokenizers`
    ByteLevel mapping)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in kept:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return tuple(out[b] for b in range(256))
