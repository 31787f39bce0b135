"""The `lcx train lm` training loop: `train(cfg, out, ...)` on token streams.

AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear warmup then cosine decay to
`min_lr_ratio * lr`, gradient clipping at 1.0, float32 (or `autocast`); batches from
`batches.weighted_batch_at`, a function of (seed, step). A fine-tune (`TrainConfig.init`) starts
from the init model's weights; the seed then only picks batches, and its curve starts from the
init's held-out loss (`val_at_init`). `--resume` reloads the init model for its architecture,
then the saved state, and continues exactly as an uninterrupted run would.

Files in `out` (written atomically, temp file + `os.replace`):
    config.json, generation_config.json, model.safetensors   HF model (float32)
    tokenizer.json, tokenizer_config.json                     HF tokenizer
    train_config.json                                         resolved TrainConfig + runtime
    state.pt                                                  resume state (removed at the end
                                                              unless keep_state)
The log (`log_path`, default `<out>/train_log.json`; gzipped when it ends in `.gz`) holds per-step losses, validation losses,
wall time, tokens seen, the config, the environment and the git SHA; a PNG curve is written
beside it (`plot_curve`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from lcx.data.io import atomic_savefig, atomic_write, atomic_write_json
from lcx.train.common import adamw_decay_matrices, warmup_cosine_lr

from .batches import PasskeyExamples, val_windows, weighted_batch_at
from .config import TrainConfig, autocast_ctx
from .corpora import CODE_CORPORA
from .metrics import copy_accuracy, copy_val_examples, evaluate, lm_loss, passkey_accuracy, passkey_val_examples
from .model import build_model, load_init


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over `warmup_steps` (step 0 gets lr/warmup), then cosine to min_lr_ratio*lr."""
    return warmup_cosine_lr(step, lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                            min_ratio=cfg.min_lr_ratio)


@dataclass
class TrainResult:
    model: torch.nn.Module
    log: dict[str, Any]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW as `train` builds it from `cfg` (weight decay on matrices only); `lcx.train.stream` uses it too."""
    return adamw_decay_matrices(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))


def _save_hf(model, tokenizer, out: Path, extra: dict[str, Any]) -> None:
    """The HF model directory (safetensors), its tokenizer and `train_config.json` (`extra`)."""
    from lcx.data.io import atomic_write_files

    def write(tmp: str) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "train_config.json"), "w") as f:
            json.dump(extra, f, indent=2)

    atomic_write_files(out, write)


def plot_curve(log: Mapping[str, Any], path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = log["step"], log["loss"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, losses, lw=0.6, alpha=0.45, color="tab:blue", label="train (per step)")
    k = max(1, len(losses) // 50)
    if len(losses) >= k > 1:
        sm = torch.tensor(losses).unfold(0, k, 1).mean(1).tolist()
        ax.plot(steps[k - 1 :], sm, color="tab:blue", label=f"train ({k}-step mean)")
    cfg = log["config"]
    held_out = "held-out packages" if cfg.get("corpus") in CODE_CORPORA else "held-out works"
    val = ([(0, log["val_at_init"])] if "val_at_init" in log else []) + [(v["step"], v["loss"]) for v in log["val"]]
    if val:
        ax.plot(*zip(*val), "o-", color="tab:red", label=f"validation ({held_out})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    att = cfg["model"].get("attention", "sdpa")
    att = "" if att == "sdpa" else f" ({att}" + (f", w={cfg['model']['window']})" if cfg["model"].get("window") else ")")
    what = "Llama LM" if cfg.get("init") is None else f"{cfg['init']} fine-tuned"
    corpus = "" if cfg.get("corpus", "text") == "text" else f" on {cfg['corpus']}"
    ax.set_title(f"{what}{corpus}{att}, {log.get('n_params', 0) / 1e6:.2f}M params, "
                 f"batch {cfg['batch_size']}x{cfg['seq_len']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """A resumable state written by `train`. States written before `environment()` stringified
    torch's version hold a `TorchVersion`, which weights_only loading must be told about."""
    with torch.serialization.safe_globals([torch.torch_version.TorchVersion]):
        return torch.load(path, map_location="cpu", weights_only=True)


def train(
    cfg: TrainConfig,
    out: str | os.PathLike,
    *,
    tokenizer,
    train_ids: Sequence[int] | torch.Tensor,
    val_ids: Sequence[int] | torch.Tensor,
    resume: bool = False,
    keep_state: bool = False,
    log_path: str | os.PathLike | None = None,
    plot: bool = True,
    progress: bool = True,
    extra_log: Mapping[str, Any] | None = None,
    stop_after: int | None = None,
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train `cfg` on token streams; write the HF model, tokenizer, log and curve under `out`.

    `resume=True` continues from `<out>/state.pt` (which must have been written with the same
    config); the result is identical to an uninterrupted run. `stop_after=k` stops once k steps
    are done (counted from step 0), leaving a checkpoint to resume from: a time-boxed run.
    `device` is where the model trains ("cpu", "cuda"): a runtime knob like the thread count
    (batches are drawn on the CPU either way; numerics, hence weights, differ between devices).
    """
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else out / "train_log.json"
    state_path = out / "state.pt"
    train_stream = torch.as_tensor(train_ids, dtype=torch.int32)
    val = val_windows(torch.as_tensor(val_ids, dtype=torch.int32), cfg.seq_len, cfg.val_windows)
    if len(tokenizer) > cfg.model.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size is {cfg.model.vocab_size}")

    if cfg.init is not None:
        model = load_init(cfg.init, cfg.model)
        if len(tokenizer) > model.config.vocab_size or tokenizer.eos_token_id != model.config.eos_token_id:
            raise ValueError(f"init {cfg.init!r}: the tokenizer does not match the model (use the init's own)")
    else:
        model = build_model(cfg.model, seed=cfg.seed, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    device = torch.device(device)
    model.to(device)
    amp = functools.partial(autocast_ctx, cfg, device.type)  # training's precision on this device
    passkey = PasskeyExamples(tokenizer) if cfg.passkey_mix > 0 else None
    retrieval = None
    if cfg.retrieval_mix > 0:
        from lcx.train.retrieval import RetrievalExamples

        retrieval = RetrievalExamples(tokenizer, train_stream, cfg.retrieval_formats, cfg.copy_vocab)
    # held-out passkey accuracy (the eval's format, full length) whenever retrieval is trained and
    # an eval-format example fits in seq_len (a short-sequence copy phase has none)
    pk_val = None
    if passkey is not None or retrieval is not None:
        try:
            pk_val = passkey_val_examples(passkey or PasskeyExamples(tokenizer), cfg.seq_len)
        except ValueError:
            if passkey is not None:
                raise
    copy_val = (copy_val_examples(retrieval, cfg.seq_len)
                if retrieval is not None and "copy" in retrieval.formats else None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, cfg)
    log: dict[str, Any] = {
        "config": cfg.to_dict(), "n_params": n_params, "train_tokens": int(train_stream.numel()),
        "val_tokens_scored": int(val[:, 1:].numel()), "step": [], "loss": [], "lr": [], "val": [],
        "wall_time_s": 0.0, "tokens_seen": 0, **(dict(extra_log) if extra_log else {}),
    }
    start = 0
    if resume:
        if not state_path.is_file():
            raise FileNotFoundError(f"--resume: no {state_path} (nothing to resume, or the run already finished)")
        state = load_state(state_path)
        saved_cfg = TrainConfig.from_dict(state["config"]).to_dict()  # fields added since: their defaults
        if saved_cfg != cfg.to_dict():
            diff = sorted(k for k in cfg.to_dict() if saved_cfg.get(k) != cfg.to_dict()[k])
            raise ValueError(f"--resume: config differs from the saved run in {diff}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        log, start = state["log"], state["step"]
        log.setdefault("resumed_at_step", []).append(start)
    elif cfg.init is not None:  # a fine-tune's curve starts from its init's held-out loss
        log["val_at_init"] = evaluate(model, val, autocast=amp)

    def checkpoint(step: int, final: bool) -> None:
        meta = {"train_config": cfg.to_dict(), "n_params": n_params, "steps_done": step,
                "runtime": {"threads": torch.get_num_threads(), "device": str(device)}}
        for k in ("git", "tokenizer", "init", "code_split", "site_code"):
            if k in log:
                meta[k] = log[k]
        _save_hf(model, tokenizer, out, meta)
        atomic_write_json(log_path, log)
        if plot:
            plot_curve(log, log_path.parent / (log_path.name.removesuffix(".gz").removesuffix(".json") + ".png"))
        if final and not keep_state:
            state_path.unlink(missing_ok=True)
        else:
            atomic_write(state_path, lambda tmp: torch.save(
                {"config": cfg.to_dict(), "step": step, "model": model.state_dict(),
                 "optimizer": opt.state_dict(), "log": log}, tmp))

    model.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc="train", unit="step",
               dynamic_ncols=True)
    t_last, ema = time.perf_counter(), None
    for step in range(start, cfg.steps):
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, w = weighted_batch_at(train_stream, cfg, step, passkey, retrieval)
        x, y = x.to(device), y.to(device)
        w = None if w is None else w.to(device)
        with amp():
            loss = lm_loss(model, x, y, w)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"loss became {loss_v} at step {step}; lower --lr")
        log["step"].append(step + 1)
        log["loss"].append(loss_v)
        log["lr"].append(lr)
        log["tokens_seen"] += tokens_per_step
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            entry = {"step": done, "loss": evaluate(model, val, autocast=amp)}
            if pk_val is not None:
                entry["passkey"] = passkey_accuracy(model, pk_val, pad_id)
            if copy_val is not None:
                entry["copy"] = copy_accuracy(model, copy_val, pad_id)
            log["val"].append(entry)
        now = time.perf_counter()
        log["wall_time_s"] += now - t_last
        t_last = now
        ema = loss_v if ema is None else 0.95 * ema + 0.05 * loss_v
        post = {"loss": f"{ema:.3f}", "lr": f"{lr:.1e}",
                "tok/s": f"{log['tokens_seen'] / max(log['wall_time_s'], 1e-9):.0f}"}
        if log["val"]:
            post["val"] = f"{log['val'][-1]['loss']:.3f}"
            if "passkey" in log["val"][-1]:
                post["pk"] = f"{log['val'][-1]['passkey']:.2f}"
            if "copy" in log["val"][-1]:
                post["copy"] = f"{log['val'][-1]['copy']:.2f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)
        held = False
        for metric, goal in (("passkey", cfg.stop_at_passkey), ("copy", cfg.stop_at_copy)):
            vals = [e.get(metric) for e in log["val"][-2:]]
            if (not held and goal is not None and len(vals) == 2 and log["val"][-1]["step"] == done
                    and all(x is not None and x >= goal for x in vals)):
                held = True  # the skill holds: stop here (the log records where and why)
                log["stopped_early"] = {"step": done, "reason": f"held-out {metric} >= {goal} at steps "
                                        f"{log['val'][-2]['step']} and {done}"}
        if done % cfg.ckpt_every == 0 or done == cfg.steps or held:
            if done == cfg.steps or held:
                log["final_val_loss"] = log["val"][-1]["loss"]
                if "passkey" in log["val"][-1]:
                    log["final_val_passkey"] = log["val"][-1]["passkey"]
                if "copy" in log["val"][-1]:
                    log["final_val_copy"] = log["val"][-1]["copy"]
                log["tokens_per_s"] = log["tokens_seen"] / max(log["wall_time_s"], 1e-9)
            checkpoint(done, final=done == cfg.steps or held)
            t_last = time.perf_counter()  # checkpoint I/O is not training time
        if held:
            break
        if stop_after is not None and done >= stop_after and done < cfg.steps:
            if done % cfg.ckpt_every:
                checkpoint(done, final=False)
            break
    bar.close()
    if start >= cfg.steps:  # resumed a run that had already finished
        checkpoint(cfg.steps, final=True)
    return TrainResult(model, log)
