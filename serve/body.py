"""Request bodies with bounded work: what a body may cost is known before it is parsed.

    limits = Limits.for_engine(max_model_len=1024)
    req = parse_body(CompletionRequest, body, limits)   # on the CPU pool; raises APIError (4xx)

A JSON body of 30 MB can hold 10M token ids or 7.5M strings. Parsing that into Python objects
holds the GIL for seconds (pydantic's strict union then reports one error per element) and
leaves ~1 GB of small objects behind, so one client would stall the event loop and every other
request. Here a body goes through three stages, each bounded by the one before:

1. `scan` (no parsing, no copies): walks the body's string delimiters with `bytes.find` and
   counts, outside strings, the commas and the opening brackets, in windows of `SCAN_WINDOW`
   bytes so that no single C call holds the GIL for long. A JSON text holds at most
   `commas + containers + 1` values, so the scan bounds what stage 2 can build. A body over
   `Limits.max_values` values, `MAX_JSON_STRINGS` strings or `MAX_JSON_CONTAINERS` arrays and
   objects is refused (413) here, in tens of milliseconds, without allocating anything.
2. `json.loads`: at most `max_values` objects, so its time and memory are bounded.
3. `check_shape`: the request's structural limits on the parsed object, each O(1) or O(#prompts):
   prompt count, token-id list lengths against max_model_len, stop strings (count and length),
   stop_token_ids, logit_bias entries, messages, /detokenize tokens. Only then does pydantic
   validate (strict) what is left, which is small.

The limits (`Limits`) are the server's, documented in README ("Serving") and in /openapi.json.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from .protocol import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    validation_error,
)

SCAN_WINDOW = 1 << 20  # bytes one `bytes.count` call scans (well under a millisecond)
MAX_JSON_STRINGS = 1 << 16  # keys included; a valid request has a few per prompt, message or stop string
MAX_JSON_CONTAINERS = 1 << 16  # arrays + objects outside strings
MIN_MAX_VALUES = 1 << 20  # Limits.max_values is at least this (and at least 2 x max_model_len)
DEFAULT_MAX_STOP = 4  # OpenAI's and vLLM's limit; `lcx serve --max-stop` raises it
TRIM_BYTES = 1 << 20  # after a body at least this large, freed heap memory goes back to the OS
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]", re.ASCII)  # a \uD800-\uDBFF escape: check its pair


@dataclass(frozen=True)
class Limits:
    """What one request may hold. `max_model_len`: tokens per prompt (and /detokenize ids);
    `max_stop`: stop strings per request; `max_values`: JSON values in a body (token ids
    included), which bounds the parse. The other limits are constants of `protocol`."""

    max_model_len: int
    max_stop: int = DEFAULT_MAX_STOP
    max_values: int = MIN_MAX_VALUES

    def __post_init__(self) -> None:
        for k in ("max_model_len", "max_stop", "max_values"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")

    @classmethod
    def for_engine(cls, max_model_len: int, max_stop: int = DEFAULT_MAX_STOP) -> "Limits":
        return cls(max_model_len=max_model_len, max_stop=max_stop,
                   max_values=max(MIN_MAX_VALUES, 2 * max_model_len + 4096))


@dataclass(frozen=True)
class Shape:
    """What `scan` counted: JSON strings, containers (arrays + objects) and commas outside strings."""

    strings: int
    containers: int
    commas: int

    @property
    def values_bound(self) -> int:
        """The most JSON values a text with these counts can hold (every value but the first of
        each container follows a comma)."""
        return self.commas + self.containers + 1


def _too_large(what: str, got: int, limit: int) -> APIError:
    return APIError(413, f"the request body holds {got}+ {what}; this server accepts at most {limit} per request "
                    "(a valid request needs far fewer; see README 'Serving: limits')", code="request_too_large")


def _count(body: bytes, subs: tuple[bytes, ...], start: int, end: int) -> list[int]:
    """Counts of each byte string of `subs` in body[start:end], in SCAN_WINDOW windows (no copy;
    the GIL is released between windows)."""
    out = [0] * len(subs)
    for a in range(start, end, SCAN_WINDOW):
        b = min(end, a + SCAN_WINDOW)
        for i, s in enumerate(subs):
            out[i] += body.count(s, a, b)
    return out


def scan(body: bytes, limits: Limits) -> Shape:
    """Count the body's strings, and its containers and commas outside strings, refusing (413)
    as soon as a count is over its limit. Work: O(len(body)) in C, in windows, plus a Python step
    per string delimiter, of which there are at most 2 x MAX_JSON_STRINGS + 1 before refusal."""
    # Upper bound first: every string has two unescaped quotes; an escaped quote is preceded by a
    # backslash, so quotes - backslash-quotes undercounts delimiters by at most the `\\"` pairs.
    quotes, escaped = _count(body, (b'"', b'\\"'), 0, len(body))
    if quotes - escaped > 2 * MAX_JSON_STRINGS + 2:
        raise _too_large("strings", (quotes - escaped) // 2, MAX_JSON_STRINGS)
    strings = containers = commas = 0
    pos, inside, n = 0, False, len(body)
    while True:
        q = body.find(b'"', pos)
        end = n if q < 0 else q
        if not inside:
            c_open, c_obj, c_comma = _count(body, (b"[", b"{", b","), pos, end)
            containers += c_open + c_obj
            commas += c_comma
            if containers > MAX_JSON_CONTAINERS:
                raise _too_large("arrays and objects", containers, MAX_JSON_CONTAINERS)
            if commas + containers + 1 > limits.max_values:
                raise _too_large("values (token ids, strings, numbers)", commas + containers + 1, limits.max_values)
        if q < 0:
            break
        if inside and _escaped(body, q, pos):
            pos = q + 1  # an escaped quote: still inside the string
            continue
        if not inside:
            strings += 1
            if strings > MAX_JSON_STRINGS:
                raise _too_large("strings", strings, MAX_JSON_STRINGS)
        inside = not inside
        pos = q + 1
    return Shape(strings, containers, commas)


def _escaped(body: bytes, q: int, start: int) -> bool:
    """Whether the quote at `q` is escaped: an odd run of backslashes before it (after `start`)."""
    i = q
    while i > start:
        w = max(start, i - 4096)
        chunk = body[w:i]
        run = len(chunk) - len(chunk.rstrip(b"\\"))
        i -= run
        if run < len(chunk):
            break
    return (q - i) % 2 == 1


def loads(body: bytes) -> Any:
    """The parsed JSON (after `scan`): malformed JSON, invalid UTF-8 and unpaired surrogate escapes
    are 400 `invalid_json`; NaN/Infinity parse (pydantic refuses them, naming the field)."""
    try:
        obj, why = json.loads(body), None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        obj, why = None, str(e)
    if why is not None:  # raised out here: as __context__, a JSONDecodeError would keep the whole text
        raise bad_request(f"malformed JSON body: {why}", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(body) and _has_lone_surrogate(obj):
        raise bad_request("malformed JSON body: a \\u escape is an unpaired UTF-16 surrogate", None, "invalid_json")
    return obj


def _has_lone_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


# ------------------------------------------------------------------------------ structural limits
def _check_len(raw: dict[str, Any], key: str, limit: int, what: str, hint: str = "") -> None:
    v = raw.get(key)
    if isinstance(v, (list, dict)) and len(v) > limit:
        raise bad_request(f"{key} has {len(v)} {what}; at most {limit} are allowed{hint}", key, "too_many_items")


def _check_prompt(raw: dict[str, Any], limits: Limits) -> None:
    p = raw.get("prompt")
    if not isinstance(p, list):
        return
    if p and isinstance(p[0], (list, str)):
        _check_len(raw, "prompt", MAX_PROMPTS, "prompts")
        lists = [x for x in p if isinstance(x, list)]
    else:
        lists = [p]
    for i, x in enumerate(lists):
        if len(x) > limits.max_model_len:
            which = f"prompt {i}" if len(lists) > 1 else "the prompt"
            raise bad_request(f"{which} has {len(x)} token ids, more than max_model_len {limits.max_model_len}; "
                              "shorten it (lcx never truncates)", "prompt", "context_length_exceeded")


def _check_sampling(raw: dict[str, Any], limits: Limits) -> None:
    stop = raw.get("stop")
    if isinstance(stop, list):
        _check_len(raw, "stop", limits.max_stop, "stop strings", " (OpenAI's and vLLM's limit is 4; "
                   "`lcx serve --max-stop` raises it)")
    for s in (stop if isinstance(stop, list) else [stop]):
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed", "stop",
                              "too_many_items")
    _check_len(raw, "stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids")
    _check_len(raw, "logit_bias", MAX_LOGIT_BIAS, "entries", " (OpenAI's limit)")


def check_shape(model: type[BaseModel], raw: Any, limits: Limits) -> None:
    """The structural limits of `model`'s body, on the parsed JSON, before pydantic."""
    if not isinstance(raw, dict):
        return  # pydantic says it must be an object
    if model is CompletionRequest:
        _check_prompt(raw, limits)
        _check_sampling(raw, limits)
    elif model is ChatCompletionRequest:
        _check_len(raw, "messages", MAX_MESSAGES, "messages")
        _check_sampling(raw, limits)
    elif model is TokenizeRequest:
        _check_len(raw, "messages", MAX_MESSAGES, "messages")
    elif model is DetokenizeRequest:
        v = raw.get("tokens")
        if isinstance(v, list) and len(v) > limits.max_model_len:
            raise bad_request(f"tokens has {len(v)} token ids, more than max_model_len {limits.max_model_len}",
                              "tokens", "too_many_items")


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> object | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def cap_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """Make glibc serve every allocation of `nbytes` or more with its own mmap, returned to the OS
    when freed. (By default glibc raises that threshold to the largest block freed so far, up to
    32 MiB: after one 30 MB body, the next ones land in the heap and its pages stay.)"""
    try:
        ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def release_memory() -> None:
    """Give the heap memory freed by a large body back to the OS (glibc's `malloc_trim`; a no-op
    elsewhere). Without it glibc keeps the pages of the body's chunks and its copies: a server
    that refused a few 30 MB bodies would stay hundreds of MB larger for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def parse_body(model: type[BaseModel], body: bytes, limits: Limits) -> Any:
    """`model` from the JSON `body`: `scan`, `loads`, `check_shape`, then pydantic (strict).
    Raises `APIError` (400, 413). Runs on the CPU pool."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    scan(body, limits)
    raw = loads(body)
    check_shape(model, raw, limits)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = validation_error(e)
    raise err  # out here: as __context__, the ValidationError would keep the parsed body
