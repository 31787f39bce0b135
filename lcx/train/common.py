"""What lcx's training loops share (`lcx train lm` / `stream` / `retrieval` through `lcx.train.lm`,
and the modular-addition study `studies.modadd`): the learning-rate schedule and AdamW's
parameter groups (strict config dicts: `lcx.configs.strict_from_dict`). Each caller keeps its own hyperparameters; only the
formulas live here, so a fix reaches every loop.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch


def warmup_cosine_lr(step: int, *, lr: float, steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Learning rate at 0-based `step`: linear warmup over `warmup_steps` (step 0 gets
    lr / warmup_steps), then cosine decay from `lr` to `min_ratio * lr` at step `steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw_decay_matrices(model: torch.nn.Module, *, lr: float, weight_decay: float,
                         betas: tuple[float, float], eps: float = 1e-8,
                         exempt: Iterable[torch.Tensor] = ()) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (tied weights once), weight decay on matrices (dim >= 2)
    only: embeddings and projections decay, norm gains and biases do not, nor the matrices in
    `exempt`. Two groups, in that order (a saved optimizer state depends on it); `foreach=False`,
    the per-tensor update every committed run used."""
    params = [p for p in model.parameters() if p.requires_grad]
    skip = {id(p) for p in exempt}
    decay = [p for p in params if p.dim() >= 2 and id(p) not in skip]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in skip]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps, foreach=False,
    )


__all__ = ["adamw_decay_matrices", "warmup_cosine_lr"]
