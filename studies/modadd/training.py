"""Training of the modular-addition encoder: the loss (cross-entropy, the consistency loss's
symmetric KL, the optional masked-character loss), AdamW with warmup + cosine decay, and
`train_run`: one `RunConfig` trained and evaluated. `optimize` is the step loop the decoder
(`decoder.train_decoder`) shares.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from lcx.data.modadd import split_pairs
from lcx.train.common import adamw_decay_matrices, warmup_cosine_lr

from .config import RunConfig
from .data import batch_at, mask_characters
from .evaluation import CURVE_SPLITS, curve_metrics, evaluate
from .model import ModAddEncoder


def symmetric_kl(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """0.5 (KL(p_a || p_b) + KL(p_b || p_a)), mean over the batch. logits: [N, C]."""
    la, lb = F.log_softmax(logits_a, -1), F.log_softmax(logits_b, -1)
    return 0.5 * ((la.exp() * (la - lb)).sum(-1) + (lb.exp() * (lb - la)).sum(-1)).mean()


def loss_fn(model: ModAddEncoder, cfg: RunConfig, ids, lengths, labels, n_pairs,
            step: int | None = None) -> tuple[torch.Tensor, dict]:
    """Cross-entropy, plus the consistency loss at its weight for `step` (full weight when
    `step` is None), plus the masked-character loss when `cfg.mlm_weight` > 0 (its mask is a
    function of (seed, step))."""
    parts: dict[str, float] = {}
    extra = torch.zeros(())
    if cfg.mlm_weight > 0:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + (step or 0) + 7)
        masked, which = mask_characters(ids, lengths, cfg.mlm_rate, g)
        logits, token_logits = model(masked, lengths, tokens=True)  # [B, 97], [B, T, V]
        if which.any():
            mlm = F.cross_entropy(token_logits[which], ids[which])
            extra = extra + cfg.mlm_weight * mlm
            parts["mlm"] = mlm.item()
    else:
        logits = model(ids, lengths)  # [B, 97]
    ce = F.cross_entropy(logits, labels)
    parts["ce"] = ce.item()
    recipe = cfg.recipe_obj
    if not (recipe.consistency if step is None else recipe.consistency_at(step, cfg.steps)):
        return ce + extra, parts
    kl = symmetric_kl(logits[:n_pairs], logits[n_pairs:])
    weight = recipe.consistency_weight if step is None else recipe.consistency_weight_at(step, cfg.steps)
    parts["kl"] = kl.item()
    return ce + weight * kl + extra, parts


def lr_at(cfg: RunConfig, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of `lr`."""
    return warmup_cosine_lr(step, lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps, min_ratio=0.1)


def build_model(cfg: RunConfig) -> ModAddEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return ModAddEncoder(cfg.model)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
               position_decay: bool = True) -> torch.optim.Optimizer:
    table = getattr(getattr(model, "pe", None), "table", None)  # learned positions only
    exempt = () if position_decay or table is None else (table.weight,)
    return adamw_decay_matrices(model, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98), exempt=exempt)


def optimize(model, opt, bar, *, lr, loss_at, grad_clip: float, name: str, log_every: int,
              after_step=None) -> dict[str, list]:
    """The training loop shared by the encoder runs and the decoder: per step (from `bar`, a
    tqdm over range(steps)) set the lr, backprop `loss_at(step)`, clip, step, then call
    `after_step(step)` if given; returns the curve of the loss's moving average every
    `log_every` steps. A non-finite loss raises."""
    curve: dict[str, list] = {"step": [], "loss": []}
    ema = None
    model.train()
    last = len(bar)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr(step)
        loss = loss_at(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        v = loss.item()
        if not math.isfinite(v):
            raise FloatingPointError(f"{name}: loss became {v} at step {step}")
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        if (step + 1) % log_every == 0 or step + 1 == last:
            curve["step"].append(step + 1)
            curve["loss"].append(round(ema, 5))
            bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if after_step is not None:
            after_step(step)
    bar.close()
    return curve


def train_run(cfg: RunConfig, *, progress: bool = True, desc: str | None = None,
              log_every: int = 25) -> tuple[ModAddEncoder, dict[str, Any]]:
    """Train one configuration and evaluate it. Returns (model, result dict)."""
    from tqdm.auto import tqdm

    split = split_pairs(cfg.split_seed)
    train_pairs = split.train[: cfg.train_pairs] if cfg.train_pairs else split.train
    model = build_model(cfg)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.position_decay)
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), disable=not progress, desc=desc or cfg.name, unit="step",
               dynamic_ncols=True, leave=False)

    def loss_at(step: int) -> torch.Tensor:
        return loss_fn(model, cfg, *batch_at(cfg, train_pairs, step), step=step)[0]

    learning: dict[str, list] = {"step": [], **{k: [] for k in CURVE_SPLITS}}
    eval_s = 0.0

    def after_step(step: int) -> None:
        nonlocal eval_s
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            t = time.perf_counter()
            learning["step"].append(step + 1)
            point = curve_metrics(model, cfg)
            for k, v in point.items():
                learning[k].append(round(v, 4))
            if progress:  # the learning curve in the log as it grows (a long run is watchable)
                bar.write(f"{cfg.name} step {step + 1}: " + " ".join(f"{k} {100 * v:.1f}%" for k, v in point.items()))
            eval_s += time.perf_counter() - t

    curve = optimize(model, opt, bar, lr=lambda step: lr_at(cfg, step), loss_at=loss_at,
                      grad_clip=cfg.grad_clip, name=cfg.name, log_every=log_every, after_step=after_step)
    if cfg.eval_every:
        curve["learning"] = learning
    train_s = time.perf_counter() - t0 - eval_s
    t1 = time.perf_counter()
    metrics = evaluate(model, cfg)
    result = {
        "name": cfg.name, "config": cfg.to_dict(), "recipe": dataclasses.asdict(cfg.recipe_obj),
        "n_params": sum(p.numel() for p in model.parameters()), "metrics": metrics, "curve": curve,
        "final_loss": curve["loss"][-1], "train_s": round(train_s, 2),
        "eval_s": round(time.perf_counter() - t1 + eval_s, 2), "threads": torch.get_num_threads(),
    }
    return model, result
