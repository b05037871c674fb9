"""The client side of a campaign, without Locust: API keys, prompts, one streamed chat request.

`stream_chat` sends one OpenAI chat completion with ``stream: true`` (and ``include_usage``) over
plain httpx, parses the server-sent events as they arrive and fills a `RequestRecord` as it goes
(first content chunk, gaps between chunks, usage), so a request cut short by the end of a run still
has what it saw. Locust users (`loadtests/locustfile.py`) call it; so can tests.

Keys for a deployed cluster (tenant → API key) come from a file (``--keys FILE``: YAML or JSON, a
mapping ``{tenant: key}`` or a ``tenants:`` list of ``{id, key}``) or from the environment:
``FAIRSHARE_LOADTEST_KEYS`` (a JSON mapping, or the path of such a file), then
``FAIRSHARE_KEY_<TENANT>`` per tenant (upper case, ``-`` and ``.`` as ``_``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Words that the SmolLM2 byte-level BPE tokenizer keeps as one token each (with their leading
# space), so that a prompt of n words is about n tokens; the usage the server returns is exact.
_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
          "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
          "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
          "when", "will", "would", "who", "so", "no")


def synth_prompt(request_id: str, n_tokens: int) -> str:
    """About `n_tokens` tokens of text, starting with the request id (no two prompts share a prefix)."""
    n = max(int(n_tokens) - 4, 1)
    words = [_WORDS[(i * 7 + len(request_id)) % len(_WORDS)] for i in range(n)]
    return f"[{request_id}] " + " ".join(words)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `t_*` are relative to the run's start.

    status: HTTP status (200, 429, ...), 0 for a connection error, or -1 while unfinished.
    outcome: "ok", "rejected" (429), "error", or "cut" (still running when the run ended).
    ttft_s: send -> first content chunk (None if none came). itl_s: gaps between content chunks.
    e2e_s: send -> end of stream. late_s: how much later than its scheduled arrival it was sent.
    """

    tenant: str
    request_id: str
    t_sched: float
    t_send: float
    prompt_tokens_planned: int
    max_tokens: int
    late_s: float = 0.0
    status: int = -1
    outcome: str = "cut"
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    retry_after_s: float | None = None
    error: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["itl_s"] = [round(x, 5) for x in self.itl_s]
        return d


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": int(max_tokens),
        "temperature": 0,
        "ignore_eos": True,  # FairShare extension: exactly max_tokens output tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_chat(http, url: str, key: str, body: dict, rec: RequestRecord, clock=time.monotonic) -> RequestRecord:
    """POST `body` to `url` (…/v1/chat/completions) with `key`, streaming; fills and returns `rec`.

    `http` is an `httpx.Client`. Never raises for HTTP or protocol errors (they end up in `rec`);
    an interruption (timeout, GreenletExit, KeyboardInterrupt) propagates with `rec` filled so far.
    """
    import httpx

    t0 = clock()
    last = None
    try:
        with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                text = resp.read().decode("utf-8", "replace")
                rec.e2e_s = clock() - t0
                rec.outcome = "rejected" if resp.status_code == 429 else "error"
                ra = resp.headers.get("retry-after")
                if ra:
                    try:
                        rec.retry_after_s = float(ra)
                    except ValueError:
                        pass
                rec.error = _error_message(text) or f"HTTP {resp.status_code}"
                return rec
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    ev = json.loads(data)
                except ValueError:
                    continue
                if "error" in ev:
                    rec.outcome = "error"
                    rec.error = str(ev["error"].get("message", ev["error"]))[:300]
                    rec.e2e_s = clock() - t0
                    return rec
                if ev.get("usage"):
                    rec.prompt_tokens = ev["usage"].get("prompt_tokens")
                    rec.completion_tokens = ev["usage"].get("completion_tokens")
                for ch in ev.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        now = clock()
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.chunks += 1
            rec.e2e_s = clock() - t0
            rec.outcome = "ok"
            return rec
    except httpx.HTTPError as e:
        rec.status = rec.status if rec.status > 0 else 0
        rec.outcome = "error"
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.e2e_s = clock() - t0
        return rec


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


# ------------------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------------------

def parse_keys(data) -> dict[str, str]:
    """{tenant: key} from a mapping, or from ``{"tenants": [{"id": .., "key": ..}, ...]}``."""
    if isinstance(data, dict) and isinstance(data.get("tenants"), list):
        return {str(t["id"]): str(t["key"]) for t in data["tenants"]}
    if isinstance(data, dict) and isinstance(data.get("keys"), dict):
        data = data["keys"]
    if not isinstance(data, dict):
        raise ValueError("a keys file is a mapping {tenant: key} (YAML or JSON)")
    return {str(k): str(v) for k, v in data.items()}


def load_keys_file(path: str | os.PathLike) -> dict[str, str]:
    import yaml

    return parse_keys(yaml.safe_load(Path(path).read_text()) or {})


def env_name(tenant: str) -> str:
    return "FAIRSHARE_KEY_" + "".join(c if c.isalnum() else "_" for c in tenant).upper()


def keys_from_env(tenants: list[str], environ=None) -> dict[str, str]:
    """Keys from ``FAIRSHARE_LOADTEST_KEYS`` (JSON mapping or a file path), then ``FAIRSHARE_KEY_<TENANT>``."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    raw = environ.get("FAIRSHARE_LOADTEST_KEYS", "").strip()
    if raw:
        out.update(parse_keys(json.loads(raw)) if raw.startswith("{") else load_keys_file(raw))
    for t in tenants:
        v = environ.get(env_name(t))
        if v and t not in out:
            out[t] = v
    return out
