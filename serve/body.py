"""Request bodies with bounded work: what a body may cost is known before it is parsed.

    limits = Limits.for_engine(max_model_len=1024)
    scanner = Scanner(limits)
    for chunk in chunks:                         # as the body arrives (on the event loop)
        scanner.feed(chunk)                      # raises APIError (413) at the first byte over a limit
    req = parse_body(CompletionRequest, body, limits, scanned=True)   # on the CPU pool; APIError (4xx)

A JSON body of 30 MB can hold 10M token ids or 7.5M strings. Parsing that into Python objects
holds the GIL for seconds (pydantic's strict union then reports one error per element) and
leaves ~1 GB of small objects behind; even receiving it costs the server ~0.1 s of CPU. Here a
body goes through three stages, each bounded by the one before:

1. `Scanner` (no parsing): fed each chunk as it arrives, it finds the string delimiters and,
   outside strings, counts the commas and brackets, with a few C passes per chunk (`replace`
   neutralises escapes, `translate` marks the structural bytes, `find`/`count` jump between them)
   and one Python step per string or bracket. A body over a `Limits` bound is refused (413) at
   the chunk that crosses it, so the rest is never read (the server answers and closes the
   connection, `lcx.serve.gate.linger_close`): an array with more items than twice the longest
   list any field allows (`Limits.max_items`; a 10M-id prompt is refused after ~12 KB), nesting
   deeper than `MAX_JSON_DEPTH`, a string longer than any prompt can be (`max_string_bytes`), more
   than `MAX_JSON_STRINGS` strings, `MAX_JSON_CONTAINERS` arrays and objects or `max_values`
   values. A JSON text holds at most `commas + containers + 1` values, so this bounds stage 2.
2. `json.loads`: at most `max_values` objects, so its time and memory are bounded.
3. `check_shape`: the request's structural limits on the parsed object, each O(1) or O(#prompts):
   prompt count, token-id list lengths against max_model_len, stop strings (count and length),
   stop_token_ids, logit_bias entries, messages, /detokenize tokens, with the field's own error
   (lists up to `max_items` get it; longer ones were refused by stage 1). Only then does pydantic
   validate (strict) what is left, which is small.

The limits (`Limits`) are the server's, documented in docs/serving.md ("Limits") and in /openapi.json.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import Request
from starlette.requests import ClientDisconnect

from pydantic import BaseModel, ValidationError

from .gate import ClientGone
from .protocol import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    LENGTH_HINT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    validation_error,
)

SCAN_WINDOW = 1 << 20  # bytes `scan` feeds the scanner at a time (a whole body, e.g. in tests)
# The scanner takes a chunk in slices of this many bytes, so that it refuses a hostile chunk after
# the first slice over a limit (uvicorn hands over ~64-256 KB at a time; 256 KB of `"a",` is 64k
# strings to split) at the cost of a few calls per slice for a valid body (~10 us per 16 KB).
SCAN_SLICE = 16 << 10
MAX_JSON_STRINGS = 1 << 16  # keys included; a valid request has a few per prompt, message or stop string
MAX_JSON_CONTAINERS = 1 << 16  # arrays + objects outside strings
MAX_JSON_DEPTH = 64  # nesting of arrays and objects (a request needs ~5; json.loads stops near 1000)
MIN_MAX_VALUES = 1 << 20  # Limits.max_values is at least this (and at least 2 x max_model_len)
DEFAULT_MAX_BODY_BYTES = 32 << 20  # `lcx serve --max-body-mb`
DEFAULT_MAX_STOP = 4  # OpenAI's and vLLM's limit; `lcx serve --max-stop` raises it
TRIM_BYTES = 1 << 20  # after a body at least this large, freed heap memory goes back to the OS
# A JSON string spends at most 12 bytes per character of the decoded text (a character outside
# the BMP written as two \uXXXX escapes), so a string of more than 12 x the characters a field
# may hold cannot be valid for it. Strings up to MIN_MAX_STRING_BYTES are still parsed, so that a
# prompt a little too long gets its field's own error (400 context_length_exceeded, in characters).
JSON_BYTES_PER_CHAR = 12
MIN_MAX_STRING_BYTES = 1 << 20
# a \uD800-\uDFFF escape (high or low surrogate): check that it is one half of a pair
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)
# bytes.translate table: brackets -> 1, every other byte -> 0
_MARKS = bytes(int(c in b"[]{}") for c in range(256))


@dataclass(frozen=True)
class Limits:
    """What one request may hold. `max_model_len`: tokens per prompt (and /detokenize ids);
    `max_stop`: stop strings per request; `max_values`: JSON values in a body (token ids
    included), which bounds the parse; `max_items`: items of one JSON array or object;
    `max_string_bytes`: bytes of one JSON string (None: the body limit only). The other limits
    are constants of `protocol` and of this module."""

    max_model_len: int
    max_stop: int = DEFAULT_MAX_STOP
    max_values: int = MIN_MAX_VALUES
    max_items: int = MIN_MAX_VALUES
    max_string_bytes: int | None = None

    def __post_init__(self) -> None:
        for k in ("max_model_len", "max_stop", "max_values", "max_items", "max_string_bytes"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}")

    @classmethod
    def for_engine(cls, max_model_len: int, max_stop: int = DEFAULT_MAX_STOP,
                   max_prompt_chars: int | None = None) -> "Limits":
        """The limits of a server with this max_model_len and --max-stop; `max_prompt_chars`: the
        longest prompt text it tokenizes (`ServerContext.prompt_char_limit`), which bounds every
        string (at JSON_BYTES_PER_CHAR, at least MIN_MAX_STRING_BYTES). `max_items` is twice the
        longest list a field allows, so a list a little over its field's limit gets that field's
        error (after parsing) and only a hostile one is cut off."""
        longest = max(max_model_len, max_stop, MAX_PROMPTS, MAX_MESSAGES, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS)
        return cls(max_model_len=max_model_len, max_stop=max_stop,
                   max_values=max(MIN_MAX_VALUES, 2 * max_model_len + 4096), max_items=2 * longest,
                   max_string_bytes=None if max_prompt_chars is None
                   else max(MIN_MAX_STRING_BYTES, JSON_BYTES_PER_CHAR * max_prompt_chars))


@dataclass(frozen=True)
class Shape:
    """What the scanner counted: JSON strings, containers (arrays + objects) and commas outside strings."""

    strings: int
    containers: int
    commas: int

    @property
    def values_bound(self) -> int:
        """The most JSON values a text with these counts can hold (every value but the first of
        each container follows a comma)."""
        return self.commas + self.containers + 1


def _too_large(what: str, got: int, limit: int, hint: str = "") -> APIError:
    return APIError(413, f"the request body holds {got}+ {what}; this server accepts at most {limit}{hint} "
                    "(a valid request needs far fewer; see lcx's docs/serving.md, 'Limits')", code="request_too_large")


class Scanner:
    """The body's shape, counted chunk by chunk as it arrives; `feed` raises `APIError` (413) at
    the first chunk that takes a count over its `Limits` bound, so a hostile body is refused
    before the rest of it is read.

    A chunk costs a few C passes (escapes neutralised with `bytes.replace`, the structural bytes
    marked with `bytes.translate`, then `find` and `count` between them) plus a Python step per
    string and per bracket, of which there are at most MAX_JSON_STRINGS + MAX_JSON_CONTAINERS
    before refusal. Exact for valid JSON; for invalid JSON the counts are only what `json.loads`
    (which refuses it) would have to build, and may be refused here first.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self.size = 0  # bytes fed
        self.strings = self.containers = self.commas = 0
        self._items: list[int] = []  # per open container: commas seen in it (= items - 1)
        self._inside = False  # in a string
        self._string_bytes = 0  # of the string we are in
        self._carry = b""  # a backslash that escapes the next chunk's first byte

    def shape(self) -> Shape:
        return Shape(self.strings, self.containers, self.commas)

    def feed(self, chunk: bytes) -> None:
        if len(chunk) <= SCAN_SLICE:
            self._feed(chunk)
            return
        view = memoryview(chunk)
        for a in range(0, len(chunk), SCAN_SLICE):
            self._feed(bytes(view[a:a + SCAN_SLICE]))

    def _feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        data = self._carry + chunk if self._carry else chunk
        self._carry = b""
        if data.endswith(b"\\"):  # a run of backslashes at the end: an odd one escapes the next byte
            if (len(data) - len(data.rstrip(b"\\"))) % 2:
                data, self._carry = data[:-1], b"\\"
        if b"\\" in data:
            # Inside a string a run of backslashes pairs up from its first one: `\\` is one
            # backslash, and a quote after the pairs is escaped when one backslash is left over.
            # Neutralised (same length), every quote left is a string delimiter.
            data = data.replace(b"\\\\", b"..").replace(b'\\"', b"..")
        lim = self.limits
        # Split at the delimiters: the pieces alternate between inside and outside strings.
        parts = data.split(b'"')
        first_inside = self._inside
        opened = (len(parts) - (1 if first_inside else 0)) // 2  # strings that start in this chunk
        self.strings += opened
        if self.strings > MAX_JSON_STRINGS:
            raise _too_large("strings", self.strings, MAX_JSON_STRINGS)
        inside_parts = parts[0::2] if first_inside else parts[1::2]
        self._inside = first_inside != (len(parts) % 2 == 0)
        if inside_parts:
            # the first piece continues a string if we were in one; the last goes on if we still are
            head = len(inside_parts[0]) + (self._string_bytes if first_inside else 0)
            longest = max(head, max(map(len, inside_parts)))
            self._string_bytes = (head if len(inside_parts) == 1 else len(inside_parts[-1])) if self._inside else 0
            if lim.max_string_bytes is not None and longest > lim.max_string_bytes:
                raise _too_large("bytes in one string", longest, lim.max_string_bytes,
                                 " (the longest prompt text this server tokenizes, as JSON; it grows with "
                                 "max_model_len, lcx serve --max-model-len)")
        outside = b"".join(parts[1::2] if first_inside else parts[0::2])
        del parts, inside_parts
        self._walk(outside)

    def _walk(self, text: bytes) -> None:
        """Count the containers of `text` (the chunk's bytes outside strings) and the commas in
        each; a Python step per bracket."""
        lim, items = self.limits, self._items
        marks = text.translate(_MARKS)
        i, n = 0, len(text)
        while True:
            j = marks.find(1, i)
            c = text.count(b",", i, n if j < 0 else j)
            if c:
                self.commas += c
                if items:
                    items[-1] += c
                    if items[-1] >= lim.max_items:
                        raise _too_large("items in one array or object", items[-1] + 1, lim.max_items,
                                         " (twice the longest list a field allows: token ids up to "
                                         "max_model_len, prompts, messages, stop_token_ids)")
                self._check_values()
            if j < 0:
                return
            if text[j] in b"[{":
                self.containers += 1
                items.append(0)
                if len(items) > MAX_JSON_DEPTH:
                    raise _too_large("levels of nested arrays and objects", len(items), MAX_JSON_DEPTH)
                if self.containers > MAX_JSON_CONTAINERS:
                    raise _too_large("arrays and objects", self.containers, MAX_JSON_CONTAINERS)
                self._check_values()
            elif items:  # ] }
                items.pop()
            i = j + 1

    def _check_values(self) -> None:
        v = self.commas + self.containers + 1
        if v > self.limits.max_values:
            raise _too_large("values (token ids, strings, numbers)", v, self.limits.max_values)


def scan(body: bytes, limits: Limits) -> Shape:
    """`Scanner` over a whole body (in SCAN_WINDOW pieces): its shape, or APIError (413)."""
    s = Scanner(limits)
    for a in range(0, len(body), SCAN_WINDOW):
        s.feed(body[a:a + SCAN_WINDOW])
    return s.shape()


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
                              f"shorten it (lcx never truncates){LENGTH_HINT}", "prompt", "context_length_exceeded")


def _check_sampling(raw: dict[str, Any], limits: Limits) -> None:
    stop = raw.get("stop")
    if isinstance(stop, list):
        _check_len(raw, "stop", limits.max_stop, "stop strings", " (OpenAI's and vLLM's limit is 4; "
                   "`lcx serve --max-stop` raises it)")
    for s in (stop if isinstance(stop, list) else [stop]):
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            raise bad_request(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed", "stop",
                              "invalid_value")
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
            raise bad_request(f"tokens has {len(v)} token ids, more than max_model_len {limits.max_model_len}"
                              f"{LENGTH_HINT}", "tokens", "too_many_items")


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


def parse_body(model: type[BaseModel], body: bytes, limits: Limits, *, scanned: bool = False) -> Any:
    """`model` from the JSON `body`: `scan` (unless `scanned`: a `Scanner` saw it as it arrived),
    `loads`, `check_shape`, then pydantic (strict). Raises `APIError` (400, 413). Runs on the CPU
    pool."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    if not scanned:
        scan(body, limits)
    raw = loads(body)
    check_shape(model, raw, limits)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = validation_error(e)
    raise err  # out here: as __context__, the ValidationError would keep the parsed body


# ---------------------------------------------------------------------- reading a request's body
INLINE_BYTES = 16 << 10  # bodies under this are parsed and tokenized on the event loop (`ServerContext.cpu`)
DEFAULT_BODY_TIMEOUT_S = 60.0  # a body must arrive within this (`lcx serve --body-timeout-s`)


class BodyReader:
    """Reads a request's body off the connection, scanned as it arrives, and parses it on the CPU
    pool (`ServerContext.body`). `cpu`: `ServerContext.cpu`, which runs a function off the event loop."""

    def __init__(self, limits: Limits, *, max_body_bytes: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 cpu: Callable[..., Awaitable[Any]]):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.limits, self.max_body_bytes, self.body_timeout_s, self.cpu = limits, max_body_bytes, body_timeout_s, cpu

    async def read_body(self, request: Request) -> bytes:
        """The body, scanned as it arrives (`lcx.serve.body.Scanner`). Refused without reading the
        rest: another Content-Type than JSON (415), more than `max_body_bytes` (413, declared or
        counted), a scan limit crossed (413), not all of it within `body_timeout_s` of the first
        read (408). The gate closes the connection of a body left unread after the answer
        (`lcx.serve.gate.linger_close`): reading a hostile body to its end would cost the server
        more than the client."""
        ctype = request.headers.get("content-type")
        if ctype is not None:
            mime = ctype.split(";", 1)[0].strip().lower()
            if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
                raise APIError(415, f"Content-Type must be application/json, got {ctype!r}",
                               code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared), "")
        scanner = Scanner(self.limits)
        chunks = None
        try:
            # one task for the whole body (a timeout per chunk would make a task per chunk)
            chunks = await asyncio.wait_for(self._receive_body(request, scanner), self.body_timeout_s)
        except asyncio.TimeoutError:
            pass  # raised below, outside this block: no chain of the cancelled task's frames
        except APIError as e:
            # Without its traceback: the frames would hold the request, the scanner and the chunks
            # in a reference cycle (the error is kept in the request's scope) that only a full
            # garbage collection frees. Under a flood of refused and timed-out bodies those
            # collections came seconds apart and took 0.1-0.6 s each, stalling every client.
            raise e.with_traceback(None) from None
        if chunks is None:
            raise APIError(408, f"the request body was not received within {self.body_timeout_s:g} s "
                           f"({scanner.size} bytes came; lcx serve --body-timeout-s)", code="request_timeout")
        body = b"".join(chunks)
        chunks.clear()
        return body

    def _too_large(self, size: int, more: str) -> APIError:
        return APIError(413, f"the request body has {size}{more} bytes; this server accepts at most "
                        f"{self.max_body_bytes} (lcx serve --max-body-mb)", code="request_too_large")

    async def _receive_body(self, request: Request, scanner: Scanner) -> list[bytes]:
        """The body's chunks, each scanned as it comes; APIError (413) at the first one over a limit."""
        chunks = []
        try:
            async for chunk in request.stream():
                if scanner.size + len(chunk) > self.max_body_bytes:
                    raise self._too_large(scanner.size + len(chunk), "+")
                scanner.feed(chunk)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return chunks

    async def parse(self, model: type[BaseModel], request: Request) -> Any:
        """The request's body as `model`: read and scanned here (`read_body`), parsed and validated
        on the CPU pool with bounded work (`lcx.serve.body`)."""
        body = await self.read_body(request)
        big = len(body) >= TRIM_BYTES
        request.state.lcx_body_bytes = len(body)
        try:
            return await self.cpu(functools.partial(parse_body, scanned=True), model, body, self.limits,
                                  inline=len(body) < INLINE_BYTES)
        except APIError as e:
            # Its traceback holds the parse frames, and so the body; the error ends up in the
            # request's scope, which the handler frames also hold: a cycle that would keep the
            # body until the next garbage collection. Cut it here.
            raise e.with_traceback(None) from None
        finally:
            del body
            if big:
                await self.cpu(release_memory)
