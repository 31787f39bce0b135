"""The decoder-only variant of the modular-addition study (`lcx train modadd --decoder --out DIR`,
`train_decoder`): a tiny `LlamaForCausalLM` with the byte tokenizer (one id per character),
trained on the lm-eval task's exact format (prompt, answer, `\\n`), saved as a Hugging Face
directory that `lm_eval --model lcx --model_args pretrained=DIR --tasks modadd_shift` evaluates.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from lcx.configs import strict_from_dict as _from_dict
from lcx.data.io import atomic_write_json, environment
from lcx.data.modadd import CANONICAL, MODULUS, OOD_TEMPLATES, PAD_ID, SHIFT_OFFSETS, encode_chars, render, split_pairs

from .config import RunConfig
from .data import sample_texts
from .recipes import Recipe, check_int, recipe_by_name
from .training import optimize, make_optimizer, lr_at


NEWLINE_ID = encode_chars("\n")[0]


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder-only variant: a tiny `LlamaForCausalLM` (RoPE) over the byte tokenizer that
    answers by generation, in the `modadd_shift` task's format `<prompt><answer>\\n`.

    `recipe` is a `Recipe` name without the consistency loss (it is defined on the encoder's
    class distribution; the decoder trains on next-character loss only). With markers, evaluate
    the export with lm-eval `--metadata '{"markers": true}'`.
    """

    recipe: str = "baseline"
    seed: int = 0
    split_seed: int = 0
    steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1.0
    warmup_steps: int = 50
    grad_clip: float = 1.0
    eval_pairs: int = 500
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        recipe = recipe_by_name(self.recipe)
        if recipe.consistency:
            raise ValueError(f"recipe={self.recipe!r}: the decoder has no consistency loss; "
                             f"use a recipe with -no_consistency")
        for name, minimum in (("seed", 0), ("split_seed", 0), ("steps", 1), ("batch_size", 1), ("warmup_steps", 0),
                              ("eval_pairs", 1), ("hidden_size", 1), ("intermediate_size", 1),
                              ("num_hidden_layers", 1), ("num_attention_heads", 1), ("max_position_embeddings", 1)):
            check_int(name, getattr(self, name), minimum)
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"hidden_size ({self.hidden_size}) / num_attention_heads ({self.num_attention_heads}) "
                             f"must be an even integer head dim")
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.weight_decay < 0 or not self.grad_clip > 0:
            raise ValueError("lr must be finite > 0, weight_decay >= 0 and grad_clip > 0")

    @property
    def recipe_obj(self) -> Recipe:
        return recipe_by_name(self.recipe)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DecoderConfig":
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_decoder(cfg: DecoderConfig):
    """`(LlamaForCausalLM, byte tokenizer)` of `cfg`, initialised from `cfg.seed`."""
    from lcx.models.tiny import tiny_llama

    model, tok = tiny_llama(
        cfg.seed, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        initializer_range=0.02)
    return model, tok


def decoder_batch(prompts: Sequence[str], answers: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids `[B, T]` = prompt + answer + `\\n` (right-padded), attention mask `[B, T]`, and the
    loss mask `[B, T]` marking the positions whose *next* character is answer or newline."""
    seqs, starts = [], []
    for p, a in zip(prompts, answers):
        pid = encode_chars(p)
        seqs.append(pid + encode_chars(a) + [NEWLINE_ID])
        starts.append(len(pid))
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)
    att = torch.zeros(len(seqs), T, dtype=torch.long)
    tgt = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        tgt[i, st - 1 : len(s) - 1] = True  # logits at st-1 predict the answer's first char
    return ids, att, tgt


def decoder_loss(model, ids, att, tgt) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean NLL over answer+newline characters, per-row exact match under teacher forcing)."""
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1]  # [B, T-1, V]
    target, mask = ids[:, 1:], tgt[:, :-1]
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    loss = (nll.view_as(mask) * mask).sum() / mask.sum()
    right = ((logits.argmax(-1) == target) | ~mask).all(-1)  # greedy decoding reproduces answer + "\n"
    return loss, right


@torch.no_grad()
def decoder_accuracy(model, prompts: Sequence[str], answers: Sequence[str], batch_size: int = 250) -> float:
    """Fraction of prompts for which greedy decoding emits exactly `answer` then `\\n`
    (checked by teacher forcing: every answer character is the argmax given the true prefix)."""
    was = model.training
    model.eval()
    hits = 0
    for i in range(0, len(prompts), batch_size):
        _, right = decoder_loss(model, *decoder_batch(prompts[i : i + batch_size], answers[i : i + batch_size]))
        hits += int(right.sum())
    model.train(was)
    return hits / len(prompts)


def evaluate_decoder(model, cfg: DecoderConfig) -> dict[str, Any]:
    """The lm-eval task's three splits (id, pos at SHIFT_OFFSETS, template) on `eval_pairs` pairs."""
    test = split_pairs(cfg.split_seed).test[: cfg.eval_pairs]
    markers = cfg.recipe_obj.markers
    answers = [str((a + b) % MODULUS) for a, b in test]

    def acc(template: str, offset: int) -> float:
        return decoder_accuracy(model, [render(a, b, template, offset, markers=markers) for a, b in test], answers)

    shift = {str(o): acc(CANONICAL, o) for o in SHIFT_OFFSETS}
    templates = [acc(t, 0) for t in OOD_TEMPLATES]
    return {"id": acc(CANONICAL, 0), "pos": sum(shift.values()) / len(shift),
            "template": sum(templates) / len(templates), "shift": shift, "templates": templates}


def train_decoder(cfg: DecoderConfig, out: str | Path | None = None, *, progress: bool = True,
                  log_every: int = 25) -> tuple[Any, Any, dict[str, Any]]:
    """Train the decoder on `recipe`'s data; with `out`, save it as a Hugging Face directory
    (`config.json`, `model.safetensors`, tokenizer files, `train_config.json` with the metrics).
    Returns (model, tokenizer, result)."""
    from tqdm.auto import tqdm

    recipe = cfg.recipe_obj
    split = split_pairs(cfg.split_seed)
    model, tok = build_decoder(cfg)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    sched = RunConfig(steps=cfg.steps, lr=cfg.lr, warmup_steps=cfg.warmup_steps)  # lr_at's schedule
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), disable=not progress, desc="decoder", unit="step", dynamic_ncols=True)

    def loss_at(step: int) -> torch.Tensor:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        pairs = [split.train[rng.randrange(len(split.train))] for _ in range(cfg.batch_size)]
        prompts = sample_texts(recipe, pairs, rng, recipe.max_offset_at(step, cfg.steps))
        return decoder_loss(model, *decoder_batch(prompts, [str((a + b) % MODULUS) for a, b in pairs]))[0]

    curve = optimize(model, opt, bar, lr=lambda step: lr_at(sched, step), loss_at=loss_at,
                      grad_clip=cfg.grad_clip, name="decoder", log_every=log_every)
    model.eval()
    result = {"config": cfg.to_dict(), "recipe": dataclasses.asdict(recipe),
              "n_params": sum(p.numel() for p in model.parameters()), "train_s": round(time.perf_counter() - t0, 2),
              "curve": curve, "metrics": evaluate_decoder(model, cfg), "threads": torch.get_num_threads()}
    if out is not None:
        save_decoder(model, tok, out, result)
    return model, tok, result


def save_decoder(model, tok, out: str | Path, result: Mapping[str, Any]) -> Path:
    """save_pretrained into a temporary sibling directory, then swap it in (never half a model)."""
    import shutil
    import tempfile

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.generation_config.pad_token_id = PAD_ID
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(tmp / "train_config.json", {**result, "environment": environment()})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
