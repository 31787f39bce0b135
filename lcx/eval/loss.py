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

from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_MAX_LOGITS_BYTES = 1 << 28  # 256 MiB of float32 logits per chunk


def hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The final hidden states `[B, T, H]` (after the final norm) that `model`'s head maps to logits.

    Runs the decoder stack (`model.base_model`, e.g. `model.model` of a `*ForCausalLM`) only, so
    every lcx patch on it (RoPE, attention methods) is in effect, exactly as in `model(ids)`.
    """
    base = model.base_model
    if base is model:
        raise ValueError(f"{type(model).__name__} has no separate decoder stack (base_model is the model "
                         "itself); chunked scoring needs a *ForCausalLM")
    return base(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`model`'s logits for `hidden: [..., H]`, as its `forward` forms them: the output embedding
    (lm_head), then the family's final soft-cap if its config has one (Gemma 2/3, NanoChat:
    `cap * tanh(logits / cap)`, `final_logit_softcapping`), then its scaling if it has one
    (`lcx.hf.models.Family.logits`: Granite divides by `logits_scaling`, HyperCLOVA X multiplies
    by it, Cohere multiplies by `logit_scale`). `check_head` verifies this against the model's
    own forward once per model."""
    from lcx.hf.models import FAMILIES

    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    if family is not None and family.logits is not None:
        op, attr = family.logits
        value = getattr(model.config, attr)
        logits = logits / value if op == "divide" else logits * value
    return logits


_HEAD_CHECKED = "_lcx_head_checked"


@torch.no_grad()
def check_head(model: torch.nn.Module) -> None:
    """Raise `ValueError` unless `head_logits(hidden_states(ids))` reproduces `model(ids).logits`
    (on 3 tokens, once per model): a family whose forward post-processes its logits in a way
    `head_logits` does not know is refused instead of scored wrongly."""
    if getattr(model, _HEAD_CHECKED, False):
        return
    param = next(model.parameters())
    ids = torch.tensor([[1, 2, 3]], device=param.device)
    want = model(input_ids=ids, use_cache=False).logits
    got = head_logits(model, hidden_states(model, ids))
    tol = 1e-6 if param.dtype in (torch.float32, torch.float64) else 1e-2
    if want.shape != got.shape or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}): its forward's logits are not "
                         "lm_head(last hidden state) with a known final scaling (lcx.hf.models.Family.logits); "
                         "lcx's chunked loss and engine (lcx.eval.loss.head_logits) do not support this family yet")
    setattr(model, _HEAD_CHECKED, True)


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
