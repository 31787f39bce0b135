"""Why LM-Infinite loses a passkey inside its window at 2x SmolLM2's context (#32 item 0).

One prompt of `lcx report`'s passkey task (the same builder, seed and key), scored by teacher
forcing: the prompt followed by " <key>" in one forward; correct when every answer token is the
model's greedy choice (what generation would produce), plus the answer's log-probability.

Experiments (each one forward of the whole sequence, no engine, no bounded cache):
  lmi:W[:cap]   LM-Infinite, 10 global keys + a window of W keys (cap: limit_distance) on the full prompt
  cut:W         vanilla on the first 10 + last W - 10 prompt tokens (positions 0..W-1), i.e. the keys
                the last query of lmi:W sees, at (nearly) the same distances
With --check, every layer of an `lmi` run checks sampled rows of lcx's attention (float32, the
report's backend) against a dense float64 Λ written out here (not lcx.attention): the last row,
rows around window/chunk boundaries and random rows; the max error is recorded per layer.

    nice -n 5 python studies/lm_infinite_window_probe.py --length 16384 --depth 0.9 \\
        --exp lmi:8192 --exp cut:8192 --check --out results/lm_infinite_16k_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lcx.threads import resolve_threads

N_GLOBAL = 10


def _rot(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, af: float) -> torch.Tensor:
    """x `[T, H, D]` rotated to positions `pos` `[T]` (HF rotate_half convention), float64."""
    ang = pos.double()[:, None] * inv_freq.double()[None, :]  # [T, D/2]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None, :] * af
    sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None, :] * af
    h = x.shape[-1] // 2
    rh = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * cos + rh * sin


def dense_lambda_rows(q, k, v, rows, inv_freq, af, n_global, n_local, limit, scale):
    """Dense float64 Λ attention of query rows `rows` (key index = position): q `[T, H, D]`,
    k/v `[T, Hkv, D]` unrotated -> `[len(rows), H, D]`. Local keys i - n_local < j <= i at true
    distance; global keys j < n_global outside the window at distance min(limit, T - 1)."""
    T, H, _ = q.shape
    rep = H // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    pos = torch.arange(T)
    k_rot = _rot(k, pos, inv_freq, af)
    k0 = _rot(k[:n_global], torch.zeros(min(n_global, T), dtype=torch.long), inv_freq, af)
    d = min(limit, T - 1)
    out = []
    for i in rows:
        qi = q[i:i + 1]
        lo = max(0, i - n_local + 1)
        s_loc = torch.einsum("hd,jhd->hj", _rot(qi, pos[i:i + 1], inv_freq, af)[0], k_rot[lo:i + 1]) * scale
        g = [j for j in range(min(n_global, T)) if i - j >= n_local]
        parts_s, parts_v = [s_loc], [v[lo:i + 1]]
        if g:
            qc = _rot(qi, torch.tensor([d]), inv_freq, af)[0]
            parts_s.insert(0, torch.einsum("hd,jhd->hj", qc, k0[g]) * scale)
            parts_v.insert(0, v[g])
        w = torch.softmax(torch.cat(parts_s, -1), -1)  # [H, n]
        out.append(torch.einsum("hj,jhd->hd", w, torch.cat(parts_v, 0)))
    return torch.stack(out)


def check_rows(T: int, n_local: int, n_rand: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    fixed = {T - 1, T - 2, n_local - 1, n_local, n_local + N_GLOBAL, 2 * n_local - 1, 2 * n_local,
             4095, 4096, 8191, 8192, 12287, 12288}
    rand = set(torch.randint(0, T, (n_rand,), generator=g).tolist())
    return sorted(r for r in fixed | rand if 0 <= r < T)


def run_one(model, tok, ids, answer, exp, check, log):
    from lcx.hf.attention_patch import attention_patched
    from lcx.hf.rope_patch import rope_basis
    from lcx.method_config import INFERENCE_BACKEND
    from lcx.methods import lm_infinite

    kind, _, spec = exp.partition(":")
    parts = [int(x) for x in spec.split(":")]
    W = parts[0]
    if kind == "cut":
        seq = ids[:N_GLOBAL] + ids[len(ids) - (W - N_GLOBAL):]
        method = None
    elif kind == "lmi":
        seq = list(ids)
        method = lm_infinite(N_GLOBAL, W, parts[1] if len(parts) > 1 else None)
    else:
        raise ValueError(exp)
    x = torch.tensor([seq + answer])
    T = x.shape[1]
    layers = model.model.layers
    errs: dict[int, float] = {}
    last_h: list[torch.Tensor] = []
    hooks = []
    inv, af = rope_basis(model)
    rows = check_rows(T, W, 24, seed=T) if (check and method is not None) else []

    def layer_hook(idx):
        def fn(mod, args, kwargs, out):
            h = kwargs["hidden_states"][0]
            last_h.append(h[len(seq) - 1].double().clone())
            if rows:
                a = mod
                D = a.head_dim
                q = a.q_proj(h).view(T, -1, D)
                k = a.k_proj(h).view(T, -1, D)
                v = a.v_proj(h).view(T, -1, D)
                ref = dense_lambda_rows(q, k, v, rows, inv, af, N_GLOBAL, W, method.limit_distance, a.scaling)
                want = torch.nn.functional.linear(ref.reshape(len(rows), -1), a.o_proj.weight.double())
                got = out[0][0, rows].double()
                errs[idx] = float((got - want).abs().max() / want.abs().max())
        return fn

    for i, layer in enumerate(layers):
        hooks.append(layer.self_attn.register_forward_hook(layer_hook(i), with_kwargs=True))
    t0 = time.perf_counter()
    try:
        ctx = attention_patched(model, method, backend=INFERENCE_BACKEND) if method else torch.no_grad()
        with ctx, torch.no_grad():
            hs = model.model(x).last_hidden_state[0, len(seq) - 1: T - 1]  # rows predicting the answer
            logits = model.lm_head(hs).double()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, -1)
    tgt = torch.tensor(answer)
    greedy = lp.argmax(-1)
    rec = {"exp": exp, "tokens": T, "answer_logprob": float(lp[torch.arange(len(answer)), tgt].sum()),
           "greedy_correct": bool((greedy == tgt).all()), "first_token_pred": tok.decode(greedy[:1]),
           "first_token_p_key": float(lp[0, tgt[0]].exp()), "greedy_text": tok.decode(greedy),
           "wall_s": round(time.perf_counter() - t0, 1)}
    if errs:
        rec["attention_rel_err_by_layer"] = [round(errs[i], 9) for i in sorted(errs)]
        rec["checked_rows"] = rows
    log(json.dumps({k: v for k, v in rec.items() if k != "checked_rows"}))
    return rec, torch.stack(last_h)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--depth", type=float, default=0.9)
    p.add_argument("--depths", default="0.1,0.37,0.63,0.9", help="the report's depth grid (sets the key)")
    p.add_argument("--exp", action="append", required=True)
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    resolve_threads(a.threads)
    from lcx.eval_tasks.passkey.data import make_docs

    import lcx
    from lcx.data.io import atomic_write_json, git_info

    model, tok = lcx.load_model(a.model)
    model.eval()
    depths = [float(x) for x in a.depths.split(",")]
    doc = next(d for d in make_docs(tok, [a.length], depths, 1, 0) if abs(d["depth"] - a.depth) < 1e-9)
    ids = tok(doc["prompts"][0], add_special_tokens=False)["input_ids"]
    answer = tok(" " + doc["key"], add_special_tokens=False)["input_ids"]
    needle = tok(doc["prompts"][0].split("The pass key is")[0], add_special_tokens=False)["input_ids"]
    info = {"model": a.model, "length": a.length, "depth": a.depth, "key": doc["key"], "prompt_tokens": len(ids),
            "needle_tokens_from_end": len(ids) - len(needle), "answer_tokens": len(answer)}
    print(json.dumps(info))
    prev = json.loads(a.out.read_text()) if a.out.exists() else {"runs": []}
    runs = [r for r in prev["runs"] if not (r["info"] == info and r["exp"] in a.exp)]
    command = "python studies/lm_infinite_window_probe.py " + " ".join(sys.argv[1:])

    def save() -> None:  # atomically; keeps what earlier invocations wrote (summary, commands)
        atomic_write_json(a.out, {**prev, "description": __doc__.split("\n\n")[0], "runs": runs})

    states = {}
    for exp in a.exp:
        rec, h = run_one(model, tok, ids, answer, exp, a.check, print)
        states[exp] = h
        runs.append({"info": info, **rec, "command": command, "git": git_info()})
        save()
    names = list(states)
    for i, x in enumerate(names):  # last prompt token's input to each layer: cosine between runs
        for y in names[i + 1:]:
            cos = torch.nn.functional.cosine_similarity(states[x], states[y], dim=-1)
            print(f"cos(last-token layer input) {x} vs {y}:", [round(float(c), 4) for c in cos])
            for r in runs:
                if r["info"] == info and r["exp"] == x:
                    r.setdefault("last_token_cos", {})[y] = [round(float(c), 5) for c in cos]
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
