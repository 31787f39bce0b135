"""A model's output head as its family's forward applies it: logits from final hidden states.

lcx forms logits from hidden states in several places (the engine's decode and prefill, the
chunked loss of `lcx.eval.loss`, the lm-eval model, `PositionedKVCache.extend_logits`), never
through the model's own forward (which would materialise `[B, T, vocab]`). `head_logits` is the
one statement of what the family's `*ForCausalLM.forward` does after lm_head (the family table,
`lcx.hf.models.Family.logits`, and a config's `final_logit_softcapping`); `check_head` compares it
with the model's own forward once per model.
"""

from __future__ import annotations

from typing import Any

import torch

from .models import FAMILIES


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
                         "lcx's chunked loss and engine (lcx.hf.head.head_logits) do not support this family yet")
    setattr(model, _HEAD_CHECKED, True)



__all__ = ["check_head", "head_logits", "hidden_states"]
