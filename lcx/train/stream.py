"""Streaming word-by-word transduction: group positions vs interleaved positions (arXiv 2505.16983).

Task: a source sentence is `S` words from a source vocabulary of `V` words; the target is the
translation of each word through a fixed random dictionary (a bijection onto a target vocabulary
of `V` words), with a fixed local reordering: adjacent pairs are swapped, target[i] =
dict[source[i ^ 1]], so target word 0 needs source word 1 and wait-k must be >= 2.
One word = one token = one streaming unit.

Models: tiny Llamas (`lcx.train.lm.build_model`, 0.40M parameters) trained in batch mode with the
wait-k mask of `lcx.cache.gpe.group_layout` (source 0..S-1, target phi..), AdamW with the
`lcx.train.lm` schedule (`lr_at`) and optimizer groups; two models, phi = `--phi` (default 0, GPE)
and phi = S, the sentence's length (the classic sequential layout: target right behind the whole source). Each is then
evaluated in streaming mode (`stream_generate`, greedy) with (a) interleaved positions (target
behind the source read so far, re-encoded when more source arrives) and (b) group positions
(target at phi + j, never re-encoded). Sentence lengths: even, `--min-length`..`--length`.

    lcx train stream                  # writes results/streaming_task.{json,png}
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lcx.cache.gpe import StreamingConfig, group_layout, stream_generate, wait_k_visible
from lcx.data.io import atomic_savefig, atomic_write_json, environment
from lcx.train.lm import ModelConfig, TrainConfig, build_model, lr_at
from lcx.train.lm.loop import make_optimizer

PAD, START, EOS, N_SPECIAL = 0, 1, 2, 3


def make_task(V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dictionary = torch.randperm(V, generator=g)  # source word w -> target word dictionary[w]
    return dictionary


def sample(n: int, lengths: tuple[int, int], V: int, dictionary: torch.Tensor, g: torch.Generator):
    """(source ids [n, Smax], target ids [n, Smax], lengths [n]); pads are PAD. Lengths are even,
    drawn uniformly from lengths[0]..lengths[1]."""
    lo, hi = lengths
    Smax = hi
    lens = lo + 2 * torch.randint(0, (hi - lo) // 2 + 1, (n,), generator=g)
    src = torch.randint(0, V, (n, Smax), generator=g)
    perm = torch.arange(Smax) ^ 1  # swap adjacent pairs (lengths even)
    tgt = dictionary[src[:, perm]] + N_SPECIAL + V
    src = src + N_SPECIAL
    pad = torch.arange(Smax)[None, :] >= lens[:, None]
    return src.masked_fill(pad, PAD), tgt.masked_fill(pad, PAD), lens


def batch_layout(lens: torch.Tensor, Smax: int, k: int, phi: int | None):
    """Per sentence, `group_layout` embedded in the padded layout [source Smax | target inputs Smax]:
    positions [B, 2Smax], mask [B, 2Smax, 2Smax]. `phi=None`: the sequential layout, phi = own length.
    Pad queries attend to themselves only (no NaN rows); pad keys are never attended."""
    B, L = lens.numel(), 2 * Smax
    pos = torch.zeros(B, L, dtype=torch.long)
    mask = torch.eye(L, dtype=torch.bool).repeat(B, 1, 1)
    for b, S in enumerate(lens.tolist()):
        p, m = group_layout(S, wait_k_visible([1] * S, k, S), S if phi is None else phi)
        idx = torch.cat([torch.arange(S), Smax + torch.arange(S)])
        pos[b, idx] = p
        mask[b, idx[:, None], idx[None, :]] = m
    return pos, mask


def train_model(tc: TrainConfig, lengths, V: int, k: int, phi: int | None, dictionary: torch.Tensor, seed: int):
    """Batch training with the padded group layout (source 0..S-1, target phi.., phi=None: S)."""
    mc = tc.model
    Smax = lengths[1]
    model = build_model(mc, seed=seed, bos_token_id=START, eos_token_id=EOS, pad_token_id=PAD)
    opt = make_optimizer(model, tc)
    g = torch.Generator().manual_seed(seed + 1)
    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(tc.steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(tc, step)
        src, tgt, lens = sample(tc.batch_size, lengths, V, dictionary, g)
        pos, mask = batch_layout(lens, Smax, k, phi)
        inp = torch.cat([src, torch.full((tc.batch_size, 1), START), tgt[:, :-1]], dim=1)  # [B, 2Smax]
        logits = model(input_ids=inp, position_ids=pos, attention_mask=mask[:, None], use_cache=False).logits[:, Smax:]
        labels = tgt.masked_fill(tgt == PAD, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        losses.append(round(loss.item(), 5))
        if step % 200 == 0 or step == tc.steps - 1:
            print(f"[phi={phi}] step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    model.eval()
    return model, losses, time.perf_counter() - t0


@torch.no_grad()
def evaluate(model, src: torch.Tensor, tgt: torch.Tensor, lens: torch.Tensor, k: int, phi: int | None) -> dict:
    """Greedy streaming in both modes, plus greedy batch decoding in the training layout.
    `phi=None` (sequential model): group mode uses phi = the sentence's own length, which a real
    stream does not know in advance (an oracle)."""
    n, Smax = src.shape
    results = {}
    n_tok = int(lens.sum())
    for mode in ("interleaved", "group"):
        tok_ok = seq_ok = reenc = enc = 0
        t1 = time.perf_counter()
        for i in range(n):
            S = int(lens[i])
            cfg = StreamingConfig(wait_k=k, mode=mode, pe_cache_length=S if phi is None else phi,
                                  start_id=START, max_target=S)
            r = stream_generate(model, [[int(w)] for w in src[i, :S]], cfg)
            ok = torch.tensor(r.tokens) == tgt[i, :S]
            tok_ok += int(ok.sum())
            seq_ok += int(ok.all())
            reenc += r.reencoded_tokens
            enc += r.cost.tokens
        results[mode] = dict(token_accuracy=tok_ok / n_tok, sequence_accuracy=seq_ok / n,
                             reencoded_tokens=reenc, encoded_tokens=enc, wall_s=round(time.perf_counter() - t1, 2))
        print(f"[phi={phi}] {mode:12s} token acc {results[mode]['token_accuracy']:.4f} seq acc "
              f"{results[mode]['sequence_accuracy']:.4f} re-encoded {reenc} encoded {enc}", flush=True)
    # Batch greedy decoding in the training layout (= group streaming, the same computation).
    pos, mask = batch_layout(lens, Smax, k, phi)
    tgt_in = torch.full((n, Smax), START)
    preds = torch.zeros(n, Smax, dtype=torch.long)
    for j in range(Smax):
        lg = model(input_ids=torch.cat([src, tgt_in], 1), position_ids=pos,
                   attention_mask=mask[:, None]).logits[:, Smax + j]
        preds[:, j] = lg.argmax(-1)
        if j + 1 < Smax:
            tgt_in[:, j + 1] = preds[:, j]
    valid = tgt != PAD
    ok = (preds == tgt) | ~valid
    results["batch_group_layout"] = dict(token_accuracy=float(((preds == tgt) & valid).sum() / valid.sum()),
                                         sequence_accuracy=float(ok.all(1).float().mean()))
    return results


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--vocab", type=int, default=24, help="words per language")
    ap.add_argument("--length", type=int, default=12, help="max source words per sentence (even)")
    ap.add_argument("--min-length", type=int, default=4, help="min source words (even)")
    ap.add_argument("--wait-k", type=int, default=2)
    ap.add_argument("--phi", type=int, default=0, help="pe_cache_length: first target position")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/streaming_task.json")


def run(args: argparse.Namespace) -> int:
    if args.length % 2 or args.length < 2:
        raise ValueError(f"--length must be even and >= 2, got {args.length}")
    if args.min_length is None:
        args.min_length = args.length
    if args.min_length % 2 or not 2 <= args.min_length <= args.length:
        raise ValueError(f"--min-length must be even and in [2, --length], got {args.min_length}")
    torch.set_num_threads(args.threads)
    V, S, k = args.vocab, args.length, args.wait_k

    mc = ModelConfig(vocab_size=N_SPECIAL + 2 * V, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                     tie_word_embeddings=True)
    tc = TrainConfig(model=mc, steps=args.steps, batch_size=args.batch_size, seq_len=2 * S, lr=args.lr,
                     warmup_steps=50, weight_decay=0.0, seed=args.seed)
    lengths = (args.min_length, S)
    dictionary = make_task(V, args.seed)
    ge = torch.Generator().manual_seed(10_000 + args.seed)
    src_eval, tgt_eval, lens_eval = sample(args.eval_n, lengths, V, dictionary, ge)

    # Two models, trained alike in batch mode, differing only in where the target group starts:
    # phi = --phi (GPE) and phi = the sentence's length (the classic sequential layout, target
    # right behind the whole source).
    runs = {}
    for name, phi in ((f"phi={args.phi}", args.phi), ("phi=S (sequential)", None)):
        model, losses, train_s = train_model(tc, lengths, V, k, phi, dictionary, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        results = evaluate(model, src_eval, tgt_eval, lens_eval, k, phi)
        runs[name] = dict(train_phi=phi, train=dict(wall_s=round(train_s, 1), final_loss=losses[-1],
                                                    losses_every_10=losses[::10]), eval=results)

    g0 = runs[f"phi={args.phi}"]["eval"]
    out = {
        "task": "word-by-word transduction, random dictionary, adjacent pairs swapped; one word = one token",
        "note": "phi=S (sequential) model in group mode uses phi = the sentence length, unknown to a real stream (oracle)",
        "config": dict({k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("command", "subcommand")}, train=tc.to_dict(), n_params=n_params),
        "runs": runs,
        "reencoded_tokens_saved": g0["interleaved"]["reencoded_tokens"] - g0["group"]["reencoded_tokens"],
        "encoded_tokens": {m: g0[m]["encoded_tokens"] for m in ("interleaved", "group")},
        "env": environment(),
    }
    atomic_write_json(args.out, out)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, run in runs.items():
        a1.plot(range(0, tc.steps, 10), run["train"]["losses_every_10"], label=f"trained {name}")
    a1.set(title="training loss (batch, wait-k mask)", xlabel="step", ylabel="CE", yscale="log")
    a1.legend()
    labels, tok, seq = [], [], []
    for name, run in runs.items():
        for mode in ("interleaved", "group"):
            labels.append(f"{name}\n{mode}")
            tok.append(run["eval"][mode]["token_accuracy"])
            seq.append(run["eval"][mode]["sequence_accuracy"])
    x = torch.arange(len(labels)).numpy()
    a2.bar(x - 0.2, tok, 0.4, label="token")
    a2.bar(x + 0.2, seq, 0.4, label="sequence")
    a2.set(xticks=x, ylim=(0, 1.05), title=f"streaming accuracy (wait-{k}, greedy)")
    a2.set_xticklabels(labels, fontsize=7)
    a2.legend()
    modes = ["interleaved", "group"]
    a3.bar(modes, [g0[m]["reencoded_tokens"] for m in modes], color=["C3", "C2"])
    a3.set(title=f"re-encoded target tokens ({args.eval_n} sentences)")
    fig.tight_layout()
    atomic_savefig(fig, Path(args.out).with_suffix(".png"), dpi=110)
    plt.close(fig)
    print(f"wrote {args.out}")
    return 0

