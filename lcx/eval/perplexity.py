"""Perplexity by context length, optionally under an lcx method config (`lcx eval ppl`).

Which tokens are scored (the same for every length, so lengths are comparable):

    held-out texts -> one token stream (each text followed by </s>, no <s>)
    stream cut into consecutive chunks of C = max(lengths) tokens; k = budget // C of them,
    evenly spaced over the stream (so every part of the held-out set is sampled):

        stream  |chunk 0|chunk 1|chunk 2|chunk 3|chunk 4|chunk 5| ...     (k = 2 chosen: 0, 5)
        n = C   [-------- window --------]                               1 window per chunk
        n = C/4 [-win-][-win-][-win-][-win-]                             4 windows per chunk

    each chunk is tiled by floor(C/n) non-overlapping windows of n tokens, and each window is
    one independent forward pass from position 0. In a window, every token but the first is
    scored (n - 1 predictions, the first token has no context), so a length n scores
    k * floor(C/n) * (n - 1) tokens out of the same k * C-token budget.

`nll` is the mean over all scored tokens; `tail_nll` only over the targets at the last `tail`
positions of each window (positions n - tail .. n - 1, all of them when n <= tail) — the
positions that are farthest beyond a short training context, so extrapolation failures show
there first. `ppl = exp(nll)`. NLL is in nats, summed in float64.

Two perplexity protocols. This module (`lcx eval ppl`, `lcx demo`, `lcx bench extrapolation`,
`lcx bench swat`) is one; the lm-eval task `lcx_ppl` (`eval_tasks/lcx_ppl/`, used by `lcx report`
and `lcx bench lmeval`) is the other. They measure different things and share no code on purpose
(a common core would change one side's committed numbers):

- text: here the split's documents (both editions of a play) joined into one stream; `lcx_ppl`
  one edition per held-out work, each work tokenized on its own.
- windows: here k chunks of C = max(lengths) spread over the stream, each tiled by windows of n,
  so every length scores the same k * C tokens; `lcx_ppl` consecutive windows of max(L) per work,
  and bucket L is each window's first L tokens (nested prefixes of the same text).
- tokens scored: here n - 1 per window (the first is context only, no <s>); `lcx_ppl` all L, the
  first after lm-eval's prefix token (BOS, else EOS), via `loglikelihood_rolling`.
- metric: here nats per token (`ppl = exp(nll)`, `tail_*` over the last `tail` positions);
  `lcx_ppl` lm-eval's word perplexity, byte perplexity and bits per byte (`lcx_ppl_tail`: the
  second half of each bucket given the first).

Use this module to compare methods on one model (per-token NLL, one tokenizer, lengths over the
same tokens), fast and without lm-eval. Use `lcx_ppl` to compare models with different tokenizers
(per word / per byte) or to report beside other lm-eval tasks (passkey) in one harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from lcx.eval.loss import sequence_nll
from lcx.method_config import INFERENCE_BACKEND, add_method_arguments, method_config_from_args

DEFAULT_MAX_TOKENS = 32768
DEFAULT_TAIL = 256


@dataclass(frozen=True)
class LengthResult:
    """Perplexity at one context length. NLL in nats per token."""

    length: int
    windows: int
    tokens: int  # scored tokens: windows * (length - 1)
    nll: float
    ppl: float
    tail: int  # positions per window in the tail metric
    tail_tokens: int
    tail_nll: float
    tail_ppl: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def select_windows(n_tokens: int, lengths: Sequence[int], max_tokens: int) -> dict[int, list[int]]:
    """Start offsets of the windows of each length (see the module docstring).

    Every length's windows are non-overlapping and lie inside the same k chunks of C = max(lengths)
    tokens, k = max(1, max_tokens // C) (fewer if the stream is shorter), so they cover at most
    max(max_tokens, C) tokens.
    """
    lengths = sorted(set(int(n) for n in lengths))
    if not lengths or lengths[0] < 2:
        raise ValueError(f"lengths must be integers >= 2, got {lengths}")
    C = lengths[-1]
    available = n_tokens // C
    if available < 1:
        raise ValueError(f"the texts have {n_tokens} tokens; the longest length {C} needs at least {C}")
    k = min(available, max(1, max_tokens // C))  # at least one chunk
    chunks = sorted({round(i * (available - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]
    return {n: [c * C + j * n for c in chunks for j in range(C // n)] for n in lengths}


@torch.inference_mode()
def _window_nll(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Per-target NLL `[B, n-1]` (float64) of windows `batch: [B, n]` (targets at positions 1..n-1).

    Chunked (`lcx.eval.loss`): the `[B, n, V]` logits are never formed, so memory beyond the
    forward pass is at most 3 * 256 MiB whatever the length and vocabulary (Gemma 3 at 16k: 17 GB
    of float32 logits otherwise); the values equal `cross_entropy(model(batch).logits.float())`."""
    return sequence_nll(model, batch)


def perplexity_by_length(
    model: torch.nn.Module,
    tokenizer,
    texts: Sequence[str] | Iterable[str],
    lengths: Sequence[int],
    *,
    spec: Any = None,
    max_tokens_per_length: int = DEFAULT_MAX_TOKENS,
    batch_size: int | None = None,
    tail: int = DEFAULT_TAIL,
    progress: bool = True,
) -> dict[int, LengthResult]:
    """Mean NLL and perplexity of `model` on `texts` at each context length in `lengths`.

    spec: the method to score under: an `lcx.MethodConfig`, its nested dict
        (`{"rope": ..., "attention": ...}`), or a RoPE spec (`RopeSpec` or HF-style dict; partial
        is fine: theta and L come from the model), applied with `lcx.patched` for the duration of
        the call; None = the model as is.
    max_tokens_per_length: token budget per length (same windows for every length; see the
        module docstring for exactly which tokens are scored).
    batch_size: windows per forward pass; default max(1, 8192 // n).
    Returns `{length: LengthResult}` in increasing length order.
    """
    from lcx.data.tokenizer import encode_documents

    ids = torch.tensor(encode_documents(tokenizer, list(texts)), dtype=torch.long)
    return perplexity_of_stream(model, ids, lengths, spec=spec, max_tokens_per_length=max_tokens_per_length,
                                batch_size=batch_size, tail=tail, progress=progress)


def perplexity_of_stream(
    model: torch.nn.Module,
    ids: torch.Tensor | Sequence[int],
    lengths: Sequence[int],
    *,
    spec: Any = None,
    max_tokens_per_length: int = DEFAULT_MAX_TOKENS,
    batch_size: int | None = None,
    tail: int = DEFAULT_TAIL,
    progress: bool = True,
) -> dict[int, LengthResult]:
    """`perplexity_by_length` on an already tokenized stream `ids: [N]` (encode once, score many specs)."""
    from tqdm.auto import tqdm

    if tail < 1:
        raise ValueError(f"tail must be >= 1, got {tail}")
    ids = torch.as_tensor(ids, dtype=torch.long)
    starts = select_windows(ids.numel(), lengths, max_tokens_per_length)
    total = sum(len(s) for s in starts.values())
    out: dict[int, LengthResult] = {}
    was_training = model.training
    model.eval()
    ctx = _patched(model, spec)
    with ctx, tqdm(total=total, desc="ppl", unit="win", disable=not progress, dynamic_ncols=True) as bar:
        for n, st in starts.items():
            bs = batch_size or max(1, 8192 // n)
            idx = torch.tensor(st)[:, None] + torch.arange(n)[None, :]  # [W, n]
            total_nll, tail_nll, tail_tokens = 0.0, 0.0, 0
            t0 = max(1, n - tail)  # first target position counted in the tail
            for i in range(0, len(st), bs):
                nll = _window_nll(model, ids[idx[i : i + bs]])  # [b, n-1]; column j = target j+1
                total_nll += nll.sum().item()
                tail_nll += nll[:, t0 - 1 :].sum().item()
                tail_tokens += nll[:, t0 - 1 :].numel()
                bar.update(nll.shape[0])
                bar.set_postfix({"n": n}, refresh=False)
            tokens = len(st) * (n - 1)
            mean, tmean = total_nll / tokens, tail_nll / tail_tokens
            out[n] = LengthResult(n, len(st), tokens, mean, math.exp(mean), n - t0, tail_tokens, tmean,
                                  math.exp(tmean))
    model.train(was_training)
    return out


def _patched(model, spec):
    """`spec` applied for the scoring. With no attention method, a hybrid local/global model (Gemma 3)
    runs as loaded but on lcx's fastest exact backend, as `lcx.engine` runs it: each sliding layer
    its own window in O(T * w) instead of transformers' masked O(T^2) pass, the global layers causal
    (`lcx.hf.attention_patch.as_loaded_method`). Exact for any RoPE here: a window is scored in one
    forward, so every key is rotated on the basis of that call, as transformers rotates it."""
    import dataclasses

    from lcx.hf.attention_patch import as_loaded_method
    from lcx.method_config import INFERENCE_BACKEND, MethodConfig

    cfg = MethodConfig.from_dict(spec)
    if cfg.attention is None:
        fast = as_loaded_method(model, INFERENCE_BACKEND)
        if fast is not None:
            cfg = dataclasses.replace(cfg, attention=fast, backend=INFERENCE_BACKEND, layers="global")
    return cfg.apply(model)


# ------------------------------------------------------------------------------------- CLI


def _parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths expects comma-separated integers, got {text!r}") from None
    if not lengths or min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"--lengths must be integers >= 2, got {text!r}")
    return sorted(set(lengths))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "Scoring: the held-out text is one token stream; the same k chunks of max(lengths) tokens\n"
        "(k = --max-tokens // max(lengths), spread evenly over the stream) are cut into\n"
        "non-overlapping windows of each length; every token of a window but the first is scored.\n"
        "`tail` columns score only the last 256 positions of each window.\n\n"
        "Examples:\n"
        "  lcx eval ppl --model tiny-5m --lengths 256,1024,4096\n"
        "  lcx eval ppl --model tiny-5m --rope yarn --factor 16 --lengths 256,512,1024 --out yarn.json\n"
        "  lcx eval ppl --model tiny-5m --rope yarn --factor 16 --rope-param beta_fast=16\n"
        "  lcx eval ppl --model tiny-5m --rope truncate --truncate-length 128\n"
        "  lcx eval ppl --model tiny-ret-5m --attention lm_infinite --n-global 10 --n-local 256 --attn-backend flash\n"
    )
    parser.add_argument("--model", default="tiny-5m",
                        help="preset name, local HF directory / .gguf, or Hub id org/name[@revision] (default tiny-5m)")
    parser.add_argument("--lengths", type=_parse_lengths, default=[256, 512, 1024],
                        help="comma-separated context lengths (default 256,512,1024)")
    parser.add_argument("--split", default="validation", choices=("validation", "train", "all"),
                        help="lcx corpus split to score (default validation: works held out of training)")
    parser.add_argument("--text-file", action="append", default=None, metavar="PATH",
                        help="score these UTF-8 text files instead of the corpus (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"token budget per length (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--batch-size", type=int, default=None, help="windows per forward (default 8192 // length)")
    parser.add_argument("--tail", type=int, default=DEFAULT_TAIL,
                        help=f"positions per window in the tail metric (default {DEFAULT_TAIL})")
    from lcx.threads import add_threads_argument

    add_threads_argument(parser)
    parser.add_argument("--out", default=None, help="write the results as JSON here (atomically)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_method_arguments(parser, json_flag="--methods")


def load_texts(split: str = "validation", files: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """(names, texts) of the corpus split, or of the given files."""
    if files:
        return list(files), [Path(f).read_text(encoding="utf-8") for f in files]
    from lcx.data import load_corpus

    docs = load_corpus(split)
    return [d.name for d in docs], [d.text for d in docs]


def resolve_spec(model, spec: Mapping[str, Any] | None):
    """Validate a (partial) spec against the model now, so a bad key fails before any work."""
    if spec is None:
        return None
    from lcx.rope import RopeSpec

    return RopeSpec.for_model(spec, model.config)


def format_table(rows: Mapping[str, Mapping[int, LengthResult]], *, tail: bool = False) -> str:
    """Plain-text table: one row per method, one column per length, ppl (or tail ppl)."""
    lengths = sorted({n for r in rows.values() for n in r})
    w = max(12, *(len(k) for k in rows)) + 2
    head = "method".ljust(w) + "".join(f"{n:>10d}" for n in lengths)
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        cells = "".join(f"{(r[n].tail_ppl if tail else r[n].ppl):>10.2f}" if n in r else f"{'':>10}" for n in lengths)
        lines.append(name.ljust(w) + cells)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from lcx.data.io import atomic_write_json, environment
    from lcx.models import load_model

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with ours
    from lcx.allocator import reuse_freed_memory
    from lcx.threads import resolve_threads

    resolve_threads(args.threads)
    reuse_freed_memory()
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    cfg = method_config_from_args(args).with_default_backend(INFERENCE_BACKEND)  # ValueError naming a bad key
    model, tok = load_model(args.model)
    spec = resolve_spec(model, cfg.rope)  # ValueError naming the key on a bad spec for this model
    names, texts = load_texts(args.split, args.text_file)
    res = perplexity_by_length(model, tok, texts, args.lengths, spec=cfg, max_tokens_per_length=args.max_tokens,
                               batch_size=args.batch_size, tail=args.tail, progress=not args.no_progress)
    label = (f"RoPE {spec.describe()}" if spec is not None else "RoPE as loaded") + (
        f", attention {cfg.attention.describe()}" if cfg.attention is not None else "")
    print(f"model {args.model}, {label}; texts: {args.text_file or args.split} ({len(texts)} documents)")
    print(f"{'length':>8} {'windows':>8} {'tokens':>8} {'nll':>8} {'ppl':>10} {'tail nll':>9} {'tail ppl':>10}")
    for n, r in res.items():
        print(f"{n:>8d} {r.windows:>8d} {r.tokens:>8d} {r.nll:>8.4f} {r.ppl:>10.2f} {r.tail_nll:>9.4f} {r.tail_ppl:>10.2f}")
    if args.out:
        atomic_write_json(args.out, {
            "model": str(args.model), "spec": spec.to_dict() if spec is not None else None,
            "methods": cfg.to_dict(),
            "texts": {"source": args.text_file or args.split, "documents": names},
            "max_tokens_per_length": args.max_tokens, "tail": args.tail,
            "results": [r.to_dict() for r in res.values()], "environment": environment(),
        })
        print(f"wrote {args.out}")
    return 0


__all__ = ["LengthResult", "format_table", "load_texts", "perplexity_by_length",
           "perplexity_of_stream",
           "resolve_spec", "select_windows"]
