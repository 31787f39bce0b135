"""`lcx rope`: show what a RoPE spec does to each rotary channel.

    lcx rope --rope yarn --factor 16 --original-max-position-embeddings 256 --head-dim 64
    lcx rope --rope llama3 --param factor=8 --param original_max_position_embeddings=8192 --check-hf
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any


def add_spec_arguments(parser: argparse.ArgumentParser, *, default_type: str | None = "default") -> None:
    """The RoPE flags every lcx command shares (--rope, --factor, --rope-theta, --param K=V)."""
    from .types import ROPE_TYPES

    g = parser.add_argument_group("RoPE spec (Hugging Face key names; unset keys come from the model)")
    g.add_argument("--rope", dest="rope_type", default=default_type, choices=sorted(ROPE_TYPES),
                   help="RoPE type (default: %(default)s)")
    g.add_argument("--factor", type=float, default=None, help="context extension factor s = new / original length")
    g.add_argument("--rope-theta", type=float, default=None, help="RoPE base b (default: the model's)")
    g.add_argument("--original-max-position-embeddings", type=int, default=None,
                   help="original context L (default: the model's max_position_embeddings)")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other RopeSpec key, e.g. --param beta_fast=16 --param truncate_length=256; "
                        "JSON values allowed (lists for short_factor/long_factor)")


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """A partial spec dict from the shared flags (None when no RoPE type was chosen)."""
    if getattr(args, "rope_type", None) is None:
        return None
    d: dict[str, Any] = {"rope_type": args.rope_type}
    for key in ("factor", "rope_theta", "original_max_position_embeddings"):
        if getattr(args, key, None) is not None:
            d[key] = getattr(args, key)
    for item in args.param:
        if "=" not in item:
            raise ValueError(f"--param expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            d[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            d[k.strip()] = v
    return d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="current sequence length, for length-dependent types (dynamic, longrope)")
    parser.add_argument("--check-hf", action="store_true",
                        help="also compute transformers' ROPE_INIT_FUNCTIONS and print the max relative difference")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from .spec import RopeSpec
    from .types import ROPE_TYPES, compute_inv_freq

    d = spec_dict_from_args(args)
    d.setdefault("rope_theta", 10_000.0)
    spec = RopeSpec.from_dict(d)
    inv_freq, af = compute_inv_freq(spec, args.head_dim, args.seq_len)
    base, _ = compute_inv_freq(RopeSpec(rope_theta=spec.rope_theta, partial_rotary_factor=spec.partial_rotary_factor),
                               args.head_dim)
    rows = []
    for i, (f, b) in enumerate(zip(inv_freq.tolist(), base.tolist())):
        rows.append({"i": i, "inv_freq": f, "wavelength": (2 * math.pi / f) if f > 0 else math.inf,
                     "ratio_to_default": f / b})
    out: dict[str, Any] = {"spec": spec.to_dict(), "attention_factor": af, "channels": rows}
    if args.check_hf:
        if not ROPE_TYPES[spec.rope_type].in_transformers:
            out["hf_max_rel_diff"] = None
            print(f"transformers has no rope_type {spec.rope_type!r}; nothing to compare")
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            cfg = LlamaConfig(hidden_size=args.head_dim * 4, num_attention_heads=4, head_dim=args.head_dim,
                              max_position_embeddings=spec.original_max_position_embeddings or 2048)
            cfg.rope_parameters = spec.to_dict()
            fn = (LlamaRotaryEmbedding.compute_default_rope_parameters if spec.rope_type == "default"
                  else ROPE_INIT_FUNCTIONS[spec.rope_type])
            theirs, af_hf = fn(cfg, None, seq_len=args.seq_len) if spec.rope_type != "default" else fn(cfg)
            rel = ((inv_freq - theirs.double()).abs() / theirs.double().abs().clamp_min(1e-30)).max().item()
            out["hf_max_rel_diff"] = rel
            out["hf_attention_factor"] = af_hf
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"spec: {spec.describe()}  {json.dumps(spec.to_dict())}")
    print(f"attention_factor: {af:.6g} (logits scale by {af * af:.6g})")
    print(f"{'i':>3} {'inv_freq':>12} {'wavelength':>12} {'x default':>10}")
    for r in rows:
        print(f"{r['i']:>3} {r['inv_freq']:>12.6g} {r['wavelength']:>12.6g} {r['ratio_to_default']:>10.4g}")
    if "hf_max_rel_diff" in out and out["hf_max_rel_diff"] is not None:
        print(f"max relative difference vs transformers: {out['hf_max_rel_diff']:.3g}")
    return 0
