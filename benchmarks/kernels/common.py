"""What the kernels' cases share: a case (`Case`), the performance goals a row can state, the Λ
configuration of the speed goals, the SDPA baseline call and the rotary table. The timer, the
ceilings and the input buffers are the bench harness's (`benchmarks.harness`, "GPU timing")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.harness import Prepared

G_LAMBDA, L_LAMBDA = 64, 4096  # the Λ configuration the kernel speed goals are stated for


@dataclass(frozen=True)
class Case:
    """One row: `group` (the op), `impl` (who runs it), `size` (a label), `setup(device, tiny)`.

    `baseline`: the row of the same group and size this one is compared with ("" = none);
    `goal(row, rows) -> dict | None` states the row's performance goal, if any.
    """

    group: str
    impl: str
    size: str
    setup: Callable[[str, bool], Prepared]
    baseline: str = ""
    goal: Callable[[dict, dict], dict | None] | None = None
    cpu: bool = False  # runs in the CPU smoke configuration

    @property
    def name(self) -> str:
        return f"{self.group}/{self.impl}/{self.size}"


def sdpa_call(q, k, v, *, causal: bool, device: str):
    """SDPA restricted to flash (GPU; memory-efficient as the second choice for decode shapes) or
    math (CPU). GQA natively (`enable_gqa`) when the kernel takes it, else with K/V heads
    repeated once here (outside the timed call). Returns (run(q, k, v), gqa_native)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = ([SDPBackend.FLASH_ATTENTION] if causal else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                ) if device == "cuda" else [SDPBackend.MATH]
    gqa = q.shape[1] != k.shape[1]

    def run(q, k, v, enable_gqa=gqa):
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)

    if not gqa:
        return run, True
    try:
        run(q, k, v)
        return run, True
    except RuntimeError:  # this torch's kernel has no native GQA: dense MHA with repeated K/V
        return None, False


def rope_inv_freq(D: int):
    """inv_freq of Llama 3's base (5e5) for head size D: the rotary table every case uses."""
    from lcx.rope import RopeSpec, compute_inv_freq

    inv, _ = compute_inv_freq(RopeSpec(rope_theta=5e5), D)
    return inv


def faster_than_baseline(what: str):
    def goal(row: dict, rows: dict) -> dict | None:
        base = rows.get(row.get("baseline", ""), {})
        if "median_ms" not in row or "median_ms" not in base:
            return None
        speedup = base["median_ms"] / row["median_ms"]
        return {"what": what, "target": 1.0, "value": round(speedup, 3), "met": speedup > 1.0}

    return goal


def bandwidth_goal(row: dict, rows: dict) -> dict | None:
    if row.get("pct_bandwidth") is None:
        return None
    return {"what": ">= 70% of measured copy bandwidth", "target": 70.0, "value": row["pct_bandwidth"],
            "met": row["pct_bandwidth"] >= 70.0}
