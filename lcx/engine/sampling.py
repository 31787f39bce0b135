"""Sampling, in vLLM's order (stated in `lcx.engine`'s docstring): penalties and the min_tokens
mask (`adjust_logits`), then greedy or temperature / min_p / top_k / top_p (`sample`), each request
with its own `torch.Generator`; logprobs of the raw distribution (`logprob_rows`)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .outputs import TokenLogprob


def logprob_rows(logits: torch.Tensor, chosen: Sequence[int], k: int,
                 log_probs: torch.Tensor | None = None) -> list[TokenLogprob]:
    """TokenLogprob per row of `logits [n, V]` for tokens `chosen [n]`, with top-k
    (`log_probs`: log_softmax(logits) of a single row [V], if already computed)."""
    lp = torch.log_softmax(logits, dim=-1) if log_probs is None else log_probs[None]
    idx = torch.tensor(list(chosen), device=lp.device)
    picked = lp.gather(1, idx[:, None]).squeeze(1).tolist()
    if k > 0:
        tv, ti = lp.topk(k, dim=-1)
        tv, ti = tv.tolist(), ti.tolist()
    out = []
    for r, (t, v) in enumerate(zip(chosen, picked)):
        top = tuple(zip(ti[r], tv[r])) if k > 0 else ()
        out.append(TokenLogprob(int(t), float(v), top))
    return out


def greedy_and_logprobs(logits: torch.Tensor, seqs: Sequence[Any]):
    """Batch-level work done once per step: argmax of every row ([B] list) and, if any row
    wants logprobs, log_softmax of all rows ([B, V])."""
    greedy = logits.argmax(-1).tolist()
    lps = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    return greedy, lps


def adjust_logits(s: Any, logits: torch.Tensor) -> torch.Tensor:
    """The logits [V] after the request's penalties and min_tokens mask, as a new float64
    tensor. A penalised logit never overflows to +-inf (it stops at float64's extremes), so only
    the mask gives -inf, and never to every token."""
    p = s.params
    x = logits.double()
    if x.data_ptr() == logits.data_ptr():  # already float64: copy before writing into it
        x = x.clone()
    V = x.shape[-1]
    if p.repetition_penalty != 1.0:
        if s.seen is None:
            s.seen = torch.zeros(V, dtype=torch.bool, device=x.device)
            ids = [t for t in s.prompt_ids + s.out_ids if t < V]
            s.seen[torch.tensor(ids, dtype=torch.long, device=x.device)] = True
        rp = p.repetition_penalty
        lowest = torch.finfo(torch.float64).min
        # both sides clamped to float64's range: any penalty > 0 leaves finite logits
        x = torch.where(s.seen, torch.where(x > 0, (x / rp).clamp(max=-lowest), (x * rp).clamp(min=lowest)), x)
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        if s.counts is None:
            s.counts = torch.zeros(V, dtype=torch.float64, device=x.device)
            for t in s.out_ids:
                s.counts[t] += 1
        x = x - p.frequency_penalty * s.counts - p.presence_penalty * (s.counts > 0).double()
    if len(s.out_ids) < p.min_tokens:
        banned = sorted(t for t in s.stop_ids if t < V)
        if 0 < len(banned) < V:  # (stop tokens covering the whole vocabulary: nothing to mask)
            x[torch.tensor(banned, dtype=torch.long, device=x.device)] = -math.inf
    return x


def sample(s: Any, logits: torch.Tensor, greedy: int | None = None) -> int:
    """The next token of request `s` from its logits [V] (`greedy`: their argmax, if known)."""
    p = s.params
    if p.adjusts_logits:
        logits, greedy = adjust_logits(s, logits), None
    if p.temperature == 0:
        return int(logits.argmax()) if greedy is None else greedy
    x = logits.double().cpu()
    probs = torch.softmax(x / p.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # logits / T overflowed (T tiny, e.g. 1e-310): the same distribution from logits - max,
        # which is <= 0 everywhere and 0 at the top token
        probs = torch.softmax((x - x.max()) / p.temperature, dim=-1)
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    if 0 < p.top_k < probs.shape[-1]:
        tv, ti = probs.topk(p.top_k)
        probs = torch.zeros_like(probs).scatter_(0, ti, tv / tv.sum())
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        # keep token j if the mass strictly before it is < top_p (the top token always stays)
        keep = (sp.cumsum(0) - sp) < p.top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=s.gen))


__all__ = ["adjust_logits", "greedy_and_logprobs", "logprob_rows", "sample"]
