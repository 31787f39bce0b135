"""`lcx rope`: show what a RoPE spec does to each rotary channel.

    lcx rope --rope yarn --factor 16 --original-max-position-embeddings 256 --head-dim 64
    lcx rope --rope llama3 --factor 8 --original-max-position-embeddings 8192 --check-hf
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any


def _parse_value(text: str) -> Any:
    """`16` -> 16, `0.5` -> 0.5, `true` -> True, `[1,2]` -> [1, 2], anything else -> the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        return text


def _rope_keys() -> list[str]:
    from .spec import RopeSpec

    return [f.name for f in dataclasses.fields(RopeSpec) if f.name != "rope_type"]


_SHOWN_KEYS = {"factor", "original_max_position_embeddings", "rope_theta", "truncate_length"}


def add_spec_arguments(parser: argparse.ArgumentParser, *, default_type: str | None = None) -> None:
    """The RoPE flags every lcx command shares: `--rope TYPE`, one `--<key>` flag per RopeSpec
    key (`--factor`, `--beta-fast`, ...), and `--rope-param KEY=VALUE` (JSON values allowed)."""
    from .types import ROPE_TYPES

    g = parser.add_argument_group(
        "RoPE spec", "Hugging Face key names. Keys left out come from the model when they can "
        "(rope_theta, original_max_position_embeddings = the model's max_position_embeddings).")
    g.add_argument("--rope", default=default_type, choices=sorted(ROPE_TYPES), metavar="TYPE",
                   help=f"rope_type to apply: {', '.join(sorted(ROPE_TYPES))} "
                        f"(default: {default_type or 'the model unchanged'})")
    for key in _rope_keys():
        g.add_argument(f"--{key.replace('_', '-')}", dest=f"rope__{key}", type=_parse_value, default=None,
                       metavar="V", help=argparse.SUPPRESS if key not in _SHOWN_KEYS else f"RopeSpec `{key}`")
    g.add_argument("--rope-param", action="append", default=[], metavar="KEY=VALUE",
                   help="any RopeSpec key (repeatable), e.g. --rope-param beta_fast=16 "
                        "--rope-param short_factor=[1,1,...]; every key also has its own flag, e.g. "
                        "--beta-fast, --attention-factor, --truncate-length, --low-freq-factor")


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The (possibly partial) HF-style spec dict the flags describe, or None for no change."""
    d: dict[str, Any] = {}
    for key in _rope_keys():
        v = getattr(args, f"rope__{key}", None)
        if v is not None:
            d[key] = v
    for item in args.rope_param:
        if "=" not in item:
            raise ValueError(f"--rope-param expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        d[k.strip().replace("-", "_")] = _parse_value(v.strip())
    if args.rope is None:
        if d:
            raise ValueError(f"RoPE keys {sorted(d)} given without --rope TYPE")
        return None
    return {"rope_type": args.rope, **d}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser, default_type="default")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="current sequence length, for length-dependent types (dynamic, longrope)")
    parser.add_argument("--check-hf", action="store_true",
                        help="also compute transformers' ROPE_INIT_FUNCTIONS and print the max relative difference")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from .spec import RopeSpec
    from .rotary import compute_inv_freq
    from .types import ROPE_TYPES

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
            hf_params = spec.to_dict()
            if spec.rope_type == "llama3":  # transformers has no defaults for these two keys
                hf_params.setdefault("low_freq_factor", 1.0)
                hf_params.setdefault("high_freq_factor", 4.0)
            cfg.rope_parameters = hf_params
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
