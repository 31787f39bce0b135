"""Streaming generation with group position encoding (GPE; arXiv 2505.16983, EIT-NLP/StreamingLLM
`StreamingLLM_GPE/`), and the classic interleaved baseline.

Source text arrives in chunks (a chunk is one source *unit*, one or more tokens). After each chunk
the model may write target tokens under the **wait-k** policy: the i-th target token (i = 0, 1, ..)
is written once `k + i` source units have been read (or the source has ended). A target token is
produced by feeding the previous target token (`start_id` for i = 0) and taking the argmax of the
logits, so the target group holds the *inputs* `[start, t_0, .., t_{i-1}]`.

Modes (`STREAMING_MODES`):

- ``"group"``: source tokens take positions ``0..S-1`` in arrival order; target inputs take their
  own group ``phi, phi+1, ..`` (``phi = pe_cache_length``, default 0) whatever the source length.
  Source tokens never attend to target tokens. Source and target live in two `PositionedKVCache`s;
  reading a chunk runs the decoder on the chunk against the source cache only, so the target is
  never re-encoded (``reencoded_tokens == 0``).
- ``"interleaved"``: one sequence ``[source | target]``, positions follow the sequence order: target
  input j sits at ``S_read + j``. When more source arrives after target tokens were written, the
  target must move behind the new source to keep source-before-target order, so every cached target
  input is re-encoded at its new position (counted in ``reencoded_tokens``).

Attention pattern of the group mode, for 2 source units of one token each, wait-k = 1, phi = 0
(rows: queries in arrival order; ``x``: attends; ``p``: position)::

               s0 s1 | start t0          p
    s0         x     |                   0
    start      x     | x                 0   (written after reading 1 unit)
    s1         x  x  |                   1   (never sees the target)
    t0         x  x  | x     x           1

`group_layout` gives exactly this (positions, mask) in the layout ``[all source | all target]``, so
a single batch forward (training, tests) reproduces the streaming computation.

Cost: each target step concatenates the two caches (``PositionedKVCache.cat``, a copy of
``(S + m)`` keys and values per layer) before a one-token decoder forward; at the sizes used here
(tens of tokens) the copy is negligible next to the forward. A production version would attend to
the two caches without copying (two-segment attention, or a preallocated buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .kv import ForwardCost, PositionedKVCache

STREAMING_MODES = ("group", "interleaved")


@dataclass(frozen=True)
class StreamingConfig:
    """`wait_k`: source units read before the first target token (>= 1; 0 is allowed and means the
    first token is written before any source); `mode`: one of `STREAMING_MODES`; `pe_cache_length`:
    phi, the first target position in group mode; `start_id`: the token fed to produce t_0;
    `max_target`: stop after this many target tokens (None: one per source unit); `eos_id`: stop
    when written (None: never)."""

    wait_k: int = 1
    mode: str = "group"
    pe_cache_length: int = 0
    start_id: int = 1
    max_target: int | None = None
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.wait_k, int) or isinstance(self.wait_k, bool) or self.wait_k < 1:
            raise ValueError(f"wait_k must be an integer >= 1, got {self.wait_k!r}")
        if self.mode not in STREAMING_MODES:
            raise ValueError(f"mode={self.mode!r} is not known; known: {list(STREAMING_MODES)}")
        if not isinstance(self.pe_cache_length, int) or self.pe_cache_length < 0:
            raise ValueError(f"pe_cache_length must be an integer >= 0, got {self.pe_cache_length!r}")
        if not isinstance(self.start_id, int) or self.start_id < 0:
            raise ValueError(f"start_id must be a token id >= 0, got {self.start_id!r}")
        if self.max_target is not None and (not isinstance(self.max_target, int) or self.max_target < 0):
            raise ValueError(f"max_target must be None or an integer >= 0, got {self.max_target!r}")


@dataclass
class StreamResult:
    """`tokens`: written target tokens; `logits`: `[n, vocab]` (float32) the logits each was chosen
    from; `src_visible[j]`: source tokens read when target input j was fed; `reencoded_tokens`:
    target tokens encoded again because more source arrived; `cost`: all decoder work."""

    tokens: list[int]
    logits: torch.Tensor
    src_visible: list[int]
    target_positions: list[int]
    reencoded_tokens: int = 0
    cost: ForwardCost = field(default_factory=ForwardCost)


class StreamingSession:
    """One streaming sequence (batch 1). `read(chunk)` then the wait-k writes; `finish()` at the end
    of the source. See the module docstring for the semantics of each mode.

    This is the reference wait-k streaming decoder, a decode loop of its own beside
    `lcx.engine.Engine` and `lcx.hf.generate.greedy_decode_ref`, because neither can express
    it: reads and writes interleave (the policy, not a token count, decides when the next target
    token is written), source and target live in two `PositionedKVCache`s with their own position
    groups (target input j at phi + j whatever the source length, which the engine's "position =
    index in the request" rules out), and `interleaved` mode moves the target cache behind new
    source. Its group-mode logits equal one batched forward under `group_layout`
    (`group_forward_logits`; tests/cache/test_gpe.py: `test_group_streaming_matches_batch_forward`),
    the layout `lcx train stream` trains with.
    """

    def __init__(self, model: nn.Module, config: StreamingConfig) -> None:
        self.model, self.cfg = model, config
        self.source = PositionedKVCache.empty(model, 1)
        self.target = PositionedKVCache.empty(model, 1)
        self.units_read = 0
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.src_visible: list[int] = []
        self.target_positions: list[int] = []
        self.reencoded_tokens = 0
        self.cost = ForwardCost()
        self.done = False
        self.source_ended = False
        self._forced: Sequence[int] | None = None

    def _target_position(self, j: int) -> int:
        if self.cfg.mode == "group":
            return self.cfg.pe_cache_length + j
        return len(self.source) + j  # interleaved: right behind the source read so far

    def _target_inputs(self) -> list[int]:
        return [self.cfg.start_id] + self.tokens

    def read(self, chunk: Sequence[int] | torch.Tensor) -> list[int]:
        """Encode one source unit (`chunk`: token ids) and write what wait-k allows; returns them."""
        if self.source_ended:
            raise ValueError("read after finish(): the source has ended")
        ids = torch.as_tensor(list(chunk) if not isinstance(chunk, torch.Tensor) else chunk, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"chunk must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        dev = self.source.token_ids.device
        # The chunk attends to the source cache only: source never sees target.
        self.cost.add(self.source.extend(self.model, ids[None].to(dev)))
        self.units_read += 1
        if self.cfg.mode == "interleaved" and len(self.target):
            # Keep [source | target] order: move the target behind the new source, re-encoding it.
            m = len(self.target)
            work = self.source.select(slice(None))
            inputs = self.target.token_ids
            pos = torch.arange(len(self.source), len(self.source) + m, device=dev)
            self.cost.add(work.extend(self.model, inputs, pos))
            self.target = work.select(slice(len(self.source), None))
            self.reencoded_tokens += m
        return self._write_allowed()

    def finish(self) -> list[int]:
        """Mark the end of the source and write until `max_target` / `eos_id`; returns the new tokens."""
        self.source_ended = True
        return self._write_allowed()

    def _limit(self) -> int | None:
        if self.cfg.max_target is not None:
            return self.cfg.max_target
        return self.units_read if self.source_ended else None

    def _write_allowed(self) -> list[int]:
        new: list[int] = []
        while not self.done:
            limit = self._limit()
            if limit is not None and len(self.tokens) >= limit:
                self.done = self.source_ended
                break
            if not self.source_ended and self.units_read < self.cfg.wait_k + len(self.tokens):
                break
            new.append(self._write_one())
        return new

    @torch.no_grad()
    def _write_one(self) -> int:
        j = len(self.tokens)
        dev = self.source.token_ids.device
        tok_in = self._target_inputs()[j]
        pos = self._target_position(j)
        work = PositionedKVCache.cat([self.source, self.target])  # [source | target], see Cost
        cost, logits = work.extend_logits(self.model, torch.tensor([[tok_in]], device=dev),
                                          torch.tensor([pos], device=dev))
        self.cost.add(cost)
        self.target = work.select(slice(len(self.source), None))
        logits = logits[0].float()
        if self._forced is not None and j < len(self._forced):
            out = int(self._forced[j])
        else:
            out = int(logits.argmax())
        self.tokens.append(out)
        self.logits.append(logits)
        self.src_visible.append(len(self.source))
        self.target_positions.append(pos)
        if self.cfg.eos_id is not None and out == self.cfg.eos_id:
            self.done = True
        return out

    def result(self) -> StreamResult:
        V = self.model.config.vocab_size
        logits = torch.stack(self.logits) if self.logits else torch.zeros(0, V)
        return StreamResult(list(self.tokens), logits, list(self.src_visible), list(self.target_positions),
                            self.reencoded_tokens, self.cost)


def stream_generate(model: nn.Module, source_chunks: Sequence[Sequence[int]], config: StreamingConfig,
                    *, forced: Sequence[int] | None = None) -> StreamResult:
    """Stream `source_chunks` (one unit each) through `model` under `config`; greedy target.

    `forced`: emit these target tokens instead of the argmax (teacher forcing; logits are still
    the model's), e.g. to compare runs with different targets."""
    if not len(source_chunks):
        raise ValueError("source_chunks must hold at least one chunk")
    session = StreamingSession(model, config)
    session._forced = forced
    was_training = model.training
    model.eval()
    try:
        for chunk in source_chunks:
            session.read(chunk)
        session.finish()
    finally:
        model.train(was_training)
    return session.result()


def wait_k_visible(unit_lengths: Sequence[int], wait_k: int, n_target: int) -> list[int]:
    """Source tokens visible to target input j (j < n_target) under wait-k: the tokens of the first
    `min(wait_k + j, n_units)` units."""
    if wait_k < 0:
        raise ValueError(f"wait_k must be >= 0, got {wait_k}")
    if n_target < 0:
        raise ValueError(f"n_target must be >= 0, got {n_target}")
    cum = [0]
    for n in unit_lengths:
        if n < 1:
            raise ValueError(f"unit_lengths must be >= 1, got {n}")
        cum.append(cum[-1] + n)
    return [cum[min(wait_k + j, len(unit_lengths))] for j in range(n_target)]


def group_layout(n_source: int, src_visible: Sequence[int], pe_cache_length: int = 0,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(positions [L], mask [L, L] bool)` of the layout ``[S source | M target inputs]``, L = S + M,
    reproducing group-mode streaming in one forward. `mask[q, k]` True: q attends to k. Source is
    causal among itself and never sees target; target input j sees source tokens
    `< src_visible[j]` and target inputs `<= j`. Positions: source `0..S-1`, target `phi+j`."""
    if n_source < 0 or pe_cache_length < 0:
        raise ValueError(f"n_source and pe_cache_length must be >= 0, got {n_source}, {pe_cache_length}")
    M = len(src_visible)
    L = n_source + M
    vis = torch.as_tensor(list(src_visible), dtype=torch.long, device=device)
    if M and (int(vis.min()) < 0 or int(vis.max()) > n_source):
        raise ValueError(f"src_visible must lie in [0, {n_source}], got {list(src_visible)}")
    mask = torch.zeros(L, L, dtype=torch.bool, device=device)
    mask[:n_source, :n_source] = torch.tril(torch.ones(n_source, n_source, dtype=torch.bool, device=device))
    mask[n_source:, :n_source] = torch.arange(n_source, device=device)[None, :] < vis[:, None]
    mask[n_source:, n_source:] = torch.tril(torch.ones(M, M, dtype=torch.bool, device=device))
    positions = torch.cat([torch.arange(n_source, device=device),
                           pe_cache_length + torch.arange(M, device=device)])
    return positions, mask


def group_forward_logits(model: nn.Module, source_ids: torch.Tensor, target_inputs: torch.Tensor,
                         src_visible: Sequence[int], pe_cache_length: int = 0) -> torch.Tensor:
    """Batch reference: logits `[B, M, vocab]` of the target inputs `[B, M]` after source `[B, S]`
    under `group_layout` (one forward, 4D boolean mask)."""
    B, S = source_ids.shape
    pos, mask = group_layout(S, src_visible, pe_cache_length, source_ids.device)
    ids = torch.cat([source_ids, target_inputs], dim=1)  # [B, S + M]
    out = model(input_ids=ids, position_ids=pos[None].expand(B, -1),
                attention_mask=mask[None, None].expand(B, 1, -1, -1), use_cache=False)
    return out.logits[:, S:]


__all__ = ["STREAMING_MODES", "StreamResult", "StreamingConfig", "StreamingSession", "group_forward_logits",
           "group_layout", "stream_generate", "wait_k_visible"]
