"""The reference decode loop: greedy decoding, one token per forward, over a cache the caller owns.

`Engine` is lcx's decode loop (batching, padding, per-row bounded caches, sampling, stop rules,
detokenization). This is the small loop beside it, for two jobs the engine cannot do:

- **the reference the engine is checked against.** `lcx.hf.greedy_generate` runs it over a
  transformers `Cache` (`BoundedKVCache` or a full `DynamicCache`), one batch of unpadded rows;
  the engine's greedy tokens equal it for every bounded attention method and for a SWAT model
  (tests/engine/test_engine_attention.py: `test_engine_batch_equals_bounded_cache_rows`,
  `test_engine_swat_model_batched_with_bounded_cache`) and with a full cache
  (tests/engine/test_engine.py: `test_batched_equals_unbatched_equals_hf_generate`);
- **decoding over a cache that is not the engine's.** `lcx bench decode` times HF's own cache
  classes (DynamicCache vs BoundedKVCache), and the PIE code-edit eval
  (`studies.code_edit.greedy_line`) decodes after an edit of a `PositionedKVCache`; the
  engine builds its cache from token ids and has no way to take either.

The loop (what `greedy_decode_ref` does, nothing more)::

    logits [B, V]  ->  t_0 = argmax  ->  feed(t_0) -> logits  ->  t_1 = argmax  -> ... -> t_{n-1}

`logits` are those after the last token already fed (the prompt's last position); the loop
stops after `max_new_tokens` tokens or when `stop` says so, and never feeds the last token it
returns (its forward would be wasted). Sampling, penalties, stop strings and batching of
requests of different lengths are the engine's; `lcx.cache.StreamingSession` has its own
wait-k policy loop (reads interleaved with writes, two caches; see its docstring).
"""

from __future__ import annotations

from typing import Callable

import torch


def greedy_decode_ref(feed: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor, max_new_tokens: int, *,
                      stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """Greedy tokens `[B, n]` (n <= max_new_tokens) continuing `logits [B, V]`.

    feed: `feed(tokens [B]) -> logits [B, V]`: run the model one position further on `tokens`
        (appending them to the caller's cache) and return the next logits. Timing, cache
        accounting and the cache itself are the caller's.
    stop: called with each new token `[B]` right after it is chosen; True ends the loop with that
        token included (e.g. EOS, or a completed line). None: run to `max_new_tokens`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    toks: list[torch.Tensor] = []
    while True:
        nxt = logits.argmax(-1)  # [B]
        toks.append(nxt)
        stopped = stop is not None and stop(nxt)  # called for every token, the last one too
        if stopped or len(toks) == max_new_tokens:
            return torch.stack(toks, dim=1)  # [B, n]
        logits = feed(nxt)  # [B, V]


__all__ = ["greedy_decode_ref"]
