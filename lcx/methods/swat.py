"""SWAT (Sliding Window Attention Training, arXiv 2502.18845) as an attention method.

For query i and head h (q~, k~: q and k rotated by RoPE at their true positions):

    o_i = sum_{i-w < j <= i} sigmoid( q~_i . k~_j / sqrt(d) - m_h * (i - j) ) v_j

w: the window, in keys, the query itself included (`lcx.masks.sliding_window(left=w - 1)`);
m_h: per-head ALiBi slopes, `lcx.attention` convention (the logit gets -m_h * |i - j|; the
paper writes b_h * (i - j) with b_h = -m_h). Default: lcx's balanced schedule for the call's
head count (`lcx.attention.balanced_alibi_slopes`: the first half of the heads penalise
distance, m > 0, the second half favour it, m < 0). Sigmoid, not softmax: no normalisation over
keys, hence no attention sink.

    ┌ keys ─────────────────────────────▶
    │ j <= i - w: weight 0 │ i - w < j <= i: sigmoid(score - m_h (i - j))
    query i

It is one `lcx.attention` call, `AttentionSpec.swat(w, H, alibi_slopes=...)` (sigmoid
activation, window mask, ALiBi), so the reference (`attention_ref`) defines it and every
backend that takes sigmoid + ALiBi runs it (ref, blockwise, flex, triton; not the softmax-only
sdpa / flash / cuda). The ALiBi distance is the key-index difference i - j, which is the
position difference because the keys a query sees are consecutive (a full history, or the last
w keys of one: what a bounded cache keeps).

Where it is meaningful: on a model trained with it (`lcx train lm --attention swat`; the bundled
`tiny-swat-5m`). Such a model records the method in its config (`lcx.hf.recorded`) and runs it
as loaded (`lcx.hf.swat`, the HF glue); `lcx.engine` and every front end read it from there.
Applying SWAT to a softmax-trained model (`--attention swat --window W`, `lcx.patch`) is
allowed, like linear interpolation without fine-tuning: it runs exactly this definition, but
the model has never seen sigmoid weights, so expect it to be much worse than the model as loaded.

Bounded: a query sees only the last w keys (`cache_window = (0, w)`), at their true distances,
so keys may be cached after RoPE (`needs_unrotated_keys` is False) and a cache of w - 1 keys
per layer decodes exactly. No decode rule (`decode_rule` None: sigmoid with a distance bias is
not a softmax over rotated keys): `lcx.engine` decodes it through `attend`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from lcx.attention import AttentionSpec, balanced_alibi_slopes
from lcx.masks.base import check_count

from .base import AttentionMethod, spec_for


@dataclass(frozen=True)
class SWAT(AttentionMethod):
    """SWAT (arXiv 2502.18845): sigmoid attention over a window of `window` keys (the query
    itself included) with per-head ALiBi, RoPE on q/k. See the module docstring.

    window:       keys each query sees, itself included (w >= 1).
    alibi_slopes: per query head, `lcx.attention` convention (the logit gets -m_h * |i - j|);
                  None: `balanced_alibi_slopes(H)` for the H heads of each call (`for_heads`).
                  A model trained with SWAT stores its slopes, so its schedule is kept.
    """

    name: ClassVar[str] = "swat"
    # explicit slopes for the 4 query heads the test grids run
    examples = ({"window": 4}, {"window": 5, "alibi_slopes": (0.5, -0.25, 0.0, 1.0)})
    window: int
    alibi_slopes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_count("window", self.window, 1)
        if self.alibi_slopes is not None:
            bad = ValueError(f"alibi_slopes must be a non-empty list of finite numbers, got {self.alibi_slopes!r}")
            if isinstance(self.alibi_slopes, (str, bytes)):
                raise bad
            try:  # one validation of the slopes (numbers, finite, non-empty): lcx.attention.AttentionSpec
                slopes = AttentionSpec(activation="sigmoid", alibi_slopes=self.alibi_slopes).alibi_slopes
            except (TypeError, ValueError):
                raise bad from None
            object.__setattr__(self, "alibi_slopes", slopes)

    def for_heads(self, n_heads: int) -> "SWAT":
        """This method with its slopes resolved for `n_heads` query heads (the balanced schedule
        when none were given); `ValueError` when given slopes do not match the head count."""
        return _for_heads(self, n_heads)

    def attend(self, q, k, v, *, rotary, backend="blockwise", scale=None, layer_idx=None, softcap=None):
        return AttentionMethod.attend(self.for_heads(q.shape[2]), q, k, v, rotary=rotary, backend=backend,
                                      scale=scale, softcap=softcap)

    def attention_spec(self, scale: float | None = None, *, n_heads: int | None = None) -> AttentionSpec:
        """The `lcx.attention` spec (`AttentionSpec.swat`); `n_heads` resolves default slopes."""
        return spec_for(self if n_heads is None else self.for_heads(n_heads), scale)

    def _spec(self, scale):
        if self.alibi_slopes is None:
            raise ValueError("swat without alibi_slopes takes balanced slopes for the heads of each call: "
                             "use attention_spec(n_heads=H) or for_heads(H)")
        return AttentionSpec.swat(self.window, len(self.alibi_slopes), alibi_slopes=self.alibi_slopes, scale=scale)

    def _call_specs(self):
        # which backends run it depends on there being slopes, not on how many: 2 heads stand in
        return (self.attention_spec(n_heads=2 if self.alibi_slopes is None else len(self.alibi_slopes)),)

    @property
    def cache_window(self):
        return (0, self.window)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if "alibi_slopes" in out:
            out["alibi_slopes"] = list(out["alibi_slopes"])  # JSON's form, so a config reads as written
        return out


@functools.lru_cache(maxsize=256)
def _for_heads(method: SWAT, n_heads: int) -> SWAT:
    if method.alibi_slopes is None:
        return SWAT(method.window, balanced_alibi_slopes(n_heads))
    if len(method.alibi_slopes) != n_heads:
        raise ValueError(f"{len(method.alibi_slopes)} SWAT alibi slopes for {n_heads} heads")
    return method


def swat(window: int, alibi_slopes=None) -> SWAT:
    """SWAT over `window` keys, the query included; slopes default to the balanced schedule."""
    return SWAT(window, alibi_slopes)
