"""Loader and public wrapper of the CUDA Λ-decode kernel (`lambda_decode.cu`).

    out, lse = lambda_decode_cuda(q [B, 1, H, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, D], *,
                                  keys=DecodeKeys(g_hi, w_lo, w_hi, capped), scale,
                                  tables=decode_tables(...) | None, out=None, lse=None)
        out [B, 1, H, D] (q's dtype), lse [B, H, 1] float32 (natural log)

One query token per row against a cache of UNROTATED keys (what `BoundedKVCache` holds), keys
rotated inside the kernel from float32 tables whose angles are formed in float64 on the host
(`lcx.rope.rope_cos_sin`), so positions of any size stay exact. The semantics (which keys
are global, local, the capped distance) come from the caller: `lcx.attention.cuda_backend`
maps an `AttentionSpec` onto `DecodeKeys` and checks it against the reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lcx.rope import rope_cos_sin

from ._build import load_cuda_extension

_HERE = Path(__file__).resolve().parent
CU_SOURCE = _HERE / "lambda_decode.cu"
HEADER = _HERE / "lambda_decode.h"
BINDING_SOURCE = _HERE / "lambda_decode_binding.cpp"
CUDA_SOURCES = (CU_SOURCE, HEADER, BINDING_SOURCE)
HEAD_DIMS = (32, 64, 128, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS_PER_BLOCK = (8, 4, 2, 1)  # instantiated tiles of query heads sharing one kv head
MIN_KEYS_PER_SPLIT = 64  # below this a split's fixed cost (prologue, merge) dominates
LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class DecodeKeys:
    """Which cached keys the query sees, as index ranges (`lcx.masks` convention, Tq = 1).

    Visible: `[0, g_hi)` then `[w_lo, w_hi)`, with `g_hi <= w_lo <= w_hi <= Tk`. With
    `capped`, keys `j < g_hi` are LM-Infinite's global keys (key at position 0, query at the
    capped distance); otherwise every key is scored at its own position.
    """

    g_hi: int
    w_lo: int
    w_hi: int
    capped: bool = False

    @property
    def n_visible(self) -> int:
        return self.g_hi + self.w_hi - self.w_lo

    def check(self, n_keys: int) -> None:
        if not 0 <= self.g_hi <= self.w_lo <= self.w_hi <= n_keys:
            raise ValueError(f"DecodeKeys {self} needs 0 <= g_hi <= w_lo <= w_hi <= Tk = {n_keys}")


@dataclass(frozen=True)
class DecodeTables:
    """float32 RoPE tables: kcos/ksin `[Bt, Tk, half]` (x attention_factor) of the keys, qtab
    `[Bt, 4, half]` = cos, sin of the query position (x a), cos, sin of the capped distance
    (x a^2: the global key's own factor a is folded in). Bt = 1 (shared positions) or B."""

    kcos: torch.Tensor
    ksin: torch.Tensor
    qtab: torch.Tensor


def decode_tables(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    q_index: int,
    cap_distance: int,
    attention_factor: float = 1.0,
) -> DecodeTables:
    """Tables for keys at `positions` (`[Tk]` or `[B, Tk]`), the query being key `q_index`."""
    pos = positions if positions.dim() == 2 else positions.unsqueeze(0)  # [Bt, Tk]
    half = inv_freq.shape[-1]
    cos, sin = rope_cos_sin(pos, inv_freq, attention_factor, torch.float64)  # [Bt, Tk, 2 half]
    kcos, ksin = cos[..., :half], sin[..., :half]
    qc, qs = kcos[:, q_index], ksin[:, q_index]  # [Bt, half]
    d = torch.tensor([cap_distance], device=pos.device)
    cc, cs = rope_cos_sin(d, inv_freq, attention_factor, torch.float64)  # [1, 2 half]
    a = attention_factor
    cap = (cc[:, :half] * a).expand_as(qc), (cs[:, :half] * a).expand_as(qc)
    qtab = torch.stack((qc, qs, *cap), dim=1)  # [Bt, 4, half]
    f32 = dict(dtype=torch.float32, memory_format=torch.contiguous_format)
    return DecodeTables(kcos.to(**f32).contiguous(), ksin.to(**f32).contiguous(), qtab.to(**f32).contiguous())


def load_extension(verbose: bool = False):
    """Compile (first call; torch caches the build) and import the torch extension. CUDA only."""
    return load_cuda_extension("lcx_lambda_decode_cuda", (BINDING_SOURCE.name, CU_SOURCE.name), verbose)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def heads_per_block(n_heads: int, n_kv_heads: int) -> int:
    """The largest instantiated tile of query heads that divides the GQA group."""
    group = n_heads // n_kv_heads
    return next(h for h in HEADS_PER_BLOCK if group % h == 0)


DEFAULT_BLOCKS_PER_SM = 2
# GPU slug (lcx.kernels.gpu_slug) -> the blocks per SM that `lcx bench kernels --tune` measured
# fastest for the lambda_decode benchmark's shape; entered by hand from
# results/kernels/<slug>.tune.json ("decode_splits"; tests/benchmarks/test_bench_kernels.py keeps
# the two equal). Empty until a GPU session has tuned.
TUNED_BLOCKS_PER_SM: dict[str, int] = {}


@functools.lru_cache(maxsize=None)
def blocks_per_sm(device_index: int) -> int:
    from lcx.kernels import gpu_slug

    return TUNED_BLOCKS_PER_SM.get(gpu_slug(torch.cuda.get_device_name(device_index)), DEFAULT_BLOCKS_PER_SM)


def default_splits(batch: int, n_heads: int, hpb: int, n_visible: int, n_sms: int,
                   per_sm: int = DEFAULT_BLOCKS_PER_SM) -> int:
    """Split-K factor: about `per_sm` blocks per SM, at least MIN_KEYS_PER_SPLIT keys per split."""
    tiles = batch * (n_heads // hpb)
    want = -(-per_sm * n_sms // tiles)
    return max(1, min(want, -(-n_visible // MIN_KEYS_PER_SPLIT), 65535))


def check_decode_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the kernel runs: raises ValueError naming the first unsupported fact."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] != 1:
        raise ValueError(f"lambda_decode_cuda decodes one query token per row, got Tq={q.shape[1]}")
    if q.device.type != "cuda":
        raise ValueError(f"lambda_decode_cuda needs CUDA tensors, got {q.device}")
    if q.dtype not in DTYPES:
        raise ValueError(f"lambda_decode_cuda supports {DTYPES}, got {q.dtype}")
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"lambda_decode_cuda supports head dims {HEAD_DIMS} with Dv == D, got "
                         f"D={q.shape[-1]}, Dv={v.shape[-1]}")
    B, H, Hkv = q.shape[0], q.shape[2], k.shape[2]
    if B > 65535 or H > 65535:
        raise ValueError(f"lambda_decode_cuda: batch {B} or heads {H} exceed the grid limit 65535")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} kv heads")


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """Unit channel stride and 16-byte aligned rows (the kernel's vector loads), else a copy."""
    vec = 16 // x.element_size()
    ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
        x.stride(d) % vec == 0 for d in range(x.dim() - 1) if x.shape[d] > 1)
    return x if ok else x.contiguous()


def lambda_decode_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    keys: DecodeKeys,
    scale: float,
    tables: DecodeTables | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    n_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of q `[B, 1, H, D]` on unrotated k, v `[B, Tk, Hkv, D]` (CUDA).

    keys: the visible ranges (`DecodeKeys`); tables: RoPE tables (`decode_tables`), None when
    q/k are already rotated (or position-free). out `[B, 1, H, D]` / lse `[B, H, 1]` float32:
    optional buffers (tests pass NaN-poisoned ones); n_splits: split-K factor (default: fill
    the GPU, `default_splits` with this GPU's `blocks_per_sm`). Returns (out, lse).
    """
    check_decode_args(q, k, v)
    keys.check(k.shape[1])
    if keys.n_visible == 0:
        raise ValueError("no visible key: the decode query must see at least one key")
    if keys.capped and tables is None:
        raise ValueError("capped global keys need rotary tables")
    B, _, H, D = q.shape
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        lse = torch.empty(B, H, 1, dtype=torch.float32, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with unit channel stride")
    if lse.shape != (B, H, 1) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 {(B, H, 1)}, got {lse.dtype} {tuple(lse.shape)}")
    hpb = heads_per_block(H, k.shape[2])
    if n_splits is None:
        index = q.device.index or 0
        n_splits = default_splits(B, H, hpb, keys.n_visible, _sm_count(index), blocks_per_sm(index))
    n_splits = max(1, min(int(n_splits), keys.n_visible))
    tabs = (None, None, None) if tables is None else (tables.kcos, tables.ksin, tables.qtab)
    load_extension().lambda_decode(
        _kernel_layout(q), _kernel_layout(k), _kernel_layout(v), out, lse, *tabs,
        keys.g_hi, keys.w_lo, keys.w_hi, keys.capped, scale * LOG2E, n_splits, hpb,
    )  # fmt: skip
    return out, lse


__all__ = [
    "BINDING_SOURCE",
    "CUDA_SOURCES",
    "CU_SOURCE",
    "DTYPES",
    "DecodeKeys",
    "DecodeTables",
    "HEAD_DIMS",
    "check_decode_args",
    "decode_tables",
    "default_splits",
    "blocks_per_sm",
    "heads_per_block",
    "lambda_decode_cuda",
    "load_extension",
]
