"""Numerical tolerances for tests, in one place.

Rule (flash-attention's): run the exact reference in float64 (`exact`) and again in the
backend's own dtype (`ref_lowp`). A backend output `actual` passes when

    max|actual - exact| <= RATIO * max|ref_lowp - exact| + ATOL_FLOOR[dtype] * max(1, max|exact|)

i.e. a backend may be at most twice as wrong as the straightforward PyTorch computation in
the same precision; the floor (a few units in the last place of the output scale) keeps the
rule meaningful when the reference happens to be nearly exact. The same rule covers
gradients and log-sum-exps. A log-sum-exp comes back in float32 from bfloat16/float16 inputs,
but its error is set by the inputs' rounding (the scores of rounded q and k), so its floor is
the inputs' dtype: pass `precision=` the inputs' dtype. (Seen on an H100 and under Triton's
interpreter: in a one-key bfloat16 case, whose lse is the score itself, the kernel was exact to
1e-7 on its rounded inputs and still 3.3x the reference's error, which had rounded its way
closer to the float64 truth on those four values.)
"""

from __future__ import annotations

import torch

RATIO = 2.0
ATOL_FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,  # eps 9.8e-4
    torch.bfloat16: 1.6e-2,  # eps 7.8e-3
}


def max_abs_err(x: torch.Tensor, exact: torch.Tensor) -> float:
    """Max |x - exact| in float64; -inf == -inf counts as exact (empty rows of an lse)."""
    x64, e64 = x.detach().to(torch.float64), exact.detach().to(torch.float64)
    if x64.shape != e64.shape:
        raise AssertionError(f"shape {tuple(x64.shape)} != {tuple(e64.shape)}")
    same_inf = torch.isinf(x64) & torch.isinf(e64) & (torch.sign(x64) == torch.sign(e64))
    diff = torch.where(same_inf, torch.zeros_like(x64), (x64 - e64).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return float(diff.max()) if diff.numel() else 0.0


def error_budget(ref_lowp: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    finite = exact.detach()[torch.isfinite(exact.detach())]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return RATIO * max_abs_err(ref_lowp, exact) + ATOL_FLOOR[dtype] * scale


def assert_within_budget(
    actual: torch.Tensor, ref_lowp: torch.Tensor, exact: torch.Tensor, *, what: str = "output",
    precision: torch.dtype | None = None,
) -> None:
    """Assert the rule above; `precision` (default `ref_lowp.dtype`) names the precision: the
    inputs' dtype where the checked value comes back wider than them (an lse)."""
    dtype = precision or ref_lowp.dtype
    err, budget = max_abs_err(actual, exact), error_budget(ref_lowp, exact, dtype)
    if not err <= budget:
        raise AssertionError(
            f"{what}: error {err:.3g} vs float64 exceeds budget {budget:.3g} "
            f"({RATIO} x reference-in-{dtype} error {max_abs_err(ref_lowp, exact):.3g} "
            f"+ floor {ATOL_FLOOR[dtype]:.1g})"
        )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a freshly allocated kernel output with NaN so unwritten elements fail the test."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**31))


def example_rope_spec(rope_type: str, *, head_dim: int, original_max_position_embeddings: int,
                      factor: float = 4.0) -> dict:
    """A spec of the registered RoPE type `rope_type` for test grids generated from the registry:
    example values for every key its entry requires, and `factor` where it takes one (longrope's
    per-channel factors sized for `head_dim`). A required key with no example value here raises
    ValueError naming it, so a new RoPE type cannot slip out of the grids silently."""
    from .rope import ROPE_TYPES

    entry = ROPE_TYPES[rope_type]
    known = {"factor": factor, "original_max_position_embeddings": original_max_position_embeddings,
             "short_factor": [1.0 + 0.1 * i for i in range(head_dim // 2)],
             "long_factor": [1.0 + 1.5 * i for i in range(head_dim // 2)]}
    missing = sorted(set(entry.required) - set(known))
    if missing:
        raise ValueError(f"no example value for {rope_type}'s required key(s) {missing}: add them to "
                         "lcx.testing.example_rope_spec")
    d: dict = {"rope_type": rope_type, **{k: known[k] for k in sorted(entry.required)}}
    if "factor" in entry.optional:
        d["factor"] = factor
    return d


def attention_layer_io(model, ids: torch.Tensor, modules: list | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states entering, output leaving) every decoder layer's attention module (`modules`,
    e.g. `lcx.hf.attention_layers(model)` for a family that names them otherwise; default: each
    `model.model.layers[i].self_attn`), from one no-grad forward of an HF `*ForCausalLM` on `ids`:
    what a patch-equivalence test compares."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    if modules is None:
        modules = [layer.self_attn for layer in model.model.layers]
    hooks = [attn.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append((kwargs.get("hidden_states", args[0] if args else None), out[0])),
        with_kwargs=True) for attn in modules]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


