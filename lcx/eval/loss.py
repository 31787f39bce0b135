"""Token log-probabilities from hidden states, in chunks of tokens: no `[B, T, vocab]` logits.

A causal LM's loss needs one number per token, log p(target), but `model(ids).logits` holds the
whole distribution at every position: `B * T * V * 4` bytes in float32, e.g. 16k tokens of Gemma 3
(V = 262,144) = 17 GB, more than the forward pass itself. Here the decoder stack runs once and the
output head (lm_head, then the family's final soft-cap or scaling if it has one: `head_logits`) is applied to `chunk` tokens
at a time:

    hidden = base_model(ids)                     # [B, T, H]   (B*T*H*4 bytes: 16k x 640 = 42 MB)
    for each chunk of c tokens (rows flattened):
        logits = head(hidden[chunk])             # [c, V]      c = max_logits_bytes // (V * 4)
        logprob = log_softmax(logits)[target]    # [c]

Peak memory of the scoring step: the chunk's logits, their log-softmax and (for a half-precision
model) one float32 copy, i.e. at most 3 * `max_logits_bytes` (default 256 MiB: 768 MiB), on top
of the hidden states. log-softmax is row-wise, so a token's value does not depend on the chunking:
`token_logprobs` equals `log_softmax(model(ids).logits)` gathered at the targets (tests/eval/
test_loss.py checks it exactly in float64 and within float32 rounding in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lcx.hf.head import check_head, head_logits, hidden_states  # (re-exported: the chunked scoring's head)

DEFAULT_MAX_LOGITS_BYTES = 1 << 28  # 256 MiB of float32 logits per chunk


def chunk_tokens(vocab_size: int, max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits take at most `max_logits_bytes`."""
    if max_logits_bytes < 4 * vocab_size:
        raise ValueError(f"max_logits_bytes={max_logits_bytes} is below one token's logits ({4 * vocab_size} bytes)")
    return max_logits_bytes // (4 * vocab_size)


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *,
                   max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
                   softmax_dtype: torch.dtype | None = torch.float32,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log p(target) [N] float64, target is the argmax [N] bool)` for `hidden: [N, H]`, `targets: [N]`.

    Logits are formed `chunk_tokens(V, max_logits_bytes)` rows at a time. `softmax_dtype`: the
    dtype log-softmax runs in (float32 by default, as `F.cross_entropy(logits.float())`; None keeps
    the model's dtype, like lm-eval's HFLM without `softmax_dtype`).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    n = hidden.shape[0]
    step = chunk_tokens(model.get_output_embeddings().weight.shape[0], max_logits_bytes)
    logprob = torch.empty(n, dtype=torch.float64, device=hidden.device)
    greedy = torch.empty(n, dtype=torch.bool, device=hidden.device)
    for i in range(0, n, step):
        lp = F.log_softmax(head_logits(model, hidden[i : i + step]), dim=-1, dtype=softmax_dtype)  # [c, V]
        t = targets[i : i + step].to(lp.device)
        logprob[i : i + step] = lp.gather(-1, t[:, None])[:, 0].double()
        greedy[i : i + step] = lp.argmax(dim=-1) == t
        del lp
    return logprob, greedy


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, input_ids: torch.Tensor, *,
                 max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES,
                 softmax_dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """Per-target NLL `[B, T-1]` (float64, nats) of `input_ids: [B, T]`: target t+1 given tokens 0..t.
    Equals `F.cross_entropy(model(input_ids).logits[:, :-1].float(), input_ids[:, 1:])`, per token
    (`softmax_dtype=None`: log-softmax in the model's dtype, e.g. float64)."""
    check_head(model)
    h = hidden_states(model, input_ids)[:, :-1]  # [B, T-1, H]
    lp, _ = token_logprobs(model, h.reshape(-1, h.shape[-1]), input_ids[:, 1:].reshape(-1),
                           max_logits_bytes=max_logits_bytes, softmax_dtype=softmax_dtype)
    return (-lp).view(input_ids.shape[0], -1)


__all__ = ["DEFAULT_MAX_LOGITS_BYTES", "check_head", "chunk_tokens", "head_logits", "hidden_states", "sequence_nll",
           "token_logprobs"]
