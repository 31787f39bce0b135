"""Detokenisation: token bytes and strings for logprob listings, and where a growing text may be
handed out (incomplete UTF-8 and stop-string prefixes held back, stop strings found)."""

from __future__ import annotations

from typing import Any, Sequence


class Detokenizer:
    """A tokenizer's text side, with the per-token strings cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._token_cache: dict[int, str] = {}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", None) or [])
        self._byte_decoder = _byte_decoder(tokenizer)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level BPE token may be part of a UTF-8 character)."""
        tok = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if self._byte_decoder is not None and tok and all(c in self._byte_decoder for c in tok) \
                and int(token_id) not in self._special_ids:
            return bytes(self._byte_decoder[c] for c in tok)
        if tok and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def token_str(self, token_id: int) -> str:
        """One token as text for logprob listings (special tokens included). A token that is not
        valid UTF-8 on its own is written `bytes:\\xNN...`, as OpenAI does, so distinct tokens
        never share a string."""
        s = self._token_cache.get(token_id)
        if s is None:
            b = self.token_bytes(token_id)
            try:
                s = b.decode("utf-8")
            except UnicodeDecodeError:
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            if len(self._token_cache) < 1 << 18:
                self._token_cache[token_id] = s
        return s


def find_stop(text: str, prev_len: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends in its new part (after `prev_len` characters):
    (index, stop), or None. A stop string can start up to len(stop) - 1 characters before the
    new part."""
    start = max(0, prev_len - max(len(x) for x in stops) + 1)
    hits = [(text.find(x, start), x) for x in stops]
    hits = [(i, x) for i, x in hits if i >= 0]
    return min(hits) if hits else None


def stable_end(text: str, sent: int, stops: Sequence[str]) -> int:
    """How far an unfinished request's `text` may be handed out (characters before `sent` are
    out already): a trailing incomplete UTF-8 sequence and a possible stop-string prefix wait."""
    end = len(text)
    while end > sent and text[end - 1] == "\ufffd":
        end -= 1
    for x in stops:
        for k in range(min(len(x) - 1, end - sent), 0, -1):
            if text.endswith(x[:k], 0, end):
                end -= k
                break
    return end


def _byte_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's printable-char -> byte table when the tokenizer is byte-level BPE, else None."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ and "ByteLevel" not in repr(decoder):
        return None
    from ..models.tiny import gpt2_bytes_to_unicode

    return {c: b for b, c in gpt2_bytes_to_unicode().items()}


__all__ = ["Detokenizer", "find_stop", "stable_end"]
