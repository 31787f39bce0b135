"""One decode plan: which keys the last query of each row sees under a method's `DecodeRule`,
in which branch, and how far each key must be re-rotated — written once, read by every cache
that runs the rule (`lcx.engine`'s slot stores, the vLLM plugin's paged rotated layout).

Two layers:

- `branches(rule, p_k, p_q)`: the rule itself, elementwise on key / query positions (numpy arrays
  or torch tensors alike: comparisons only) -> (window, side, middle) masks. A key is in exactly
  one branch, or in none:

      window   p_q - window < p_k <= p_q                        (window None: every key)
      side     p_k <= p_q - window, p_k < side                  (side None: every older key)
      middle   p_k <= p_q - window, p_k >= side, rule.top_k     (LM-Infinite's top-k candidates)

  `lcx.engine.kv.DecodeStep` applies it to the positions its slots hold.
- `step_plan(rule, n_keys) -> StepPlan`: for rows whose histories are positions 0..n-1 (the
  query the last key, p_q = n - 1), every key a row may see, in order: a bounded rule (window
  and side both set, no top-k) enumerates the first min(side, n - window) positions then the
  last window (K = min(max n, side + window) entries, a row's unused ones invisible padding at
  position 0); any other rule every position (K = max n). Each key's `delta`: the rotation that
  moves a key cached rotated at its TRUE position to where the rule scores it, relative to a
  query rotated at its true position too:

      side key    delta = (side_key(p_k) - p_k) - (side_query(p_q) - p_q) = a(p_k) - b(p_q)
      middle key  delta = a(p_k) - (top_k_query - p_q)
      window key  delta = 0 (read as cached)

  so the score is q.R(p_k + delta - p_q)k. `RuleShifts` holds a(p), b(p) as tables (the rule's
  own float64 torch maps, evaluated once per position).

        LM-Infinite G=2, L=4, limit 4; n = 9 (p_q = 8), K = G + L:
        keys   0  1 | 5  6  7  8      delta  -(min(4, 8) - 8) - p_k: 4  3 | 0  0  0  0

Backends (`PLAN_BACKENDS`, the `lcx.attention` pattern: same signature, `supports(rule) ->
reason | None`): "ref" (numpy, this module; defines the plan) and "cpp" (the C++ extension's
`rule_plan`, `lcx.kernels.cpu`: one pass over the B x K entries, no top-k branch; equal to "ref"
bit for bit, tests/methods/test_plan.py). `step_plan(..., backend="auto")` takes "cpp" where it
runs the rule and the extension builds, else "ref".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:  # annotations only: `lcx.methods.base` reads its rule's branches from here
    from .base import DecodeRule


def branches(rule: DecodeRule, p_k, p_q):
    """(window, side, middle) bool masks of keys at positions `p_k` seen by queries at `p_q`
    (broadcasting numpy arrays or torch tensors; keys 0 <= p_k <= p_q: the caller masks empty
    slots and padding). See the module docstring."""
    window = (p_k <= p_q) if rule.window is None else (p_k > p_q - rule.window)
    older = ~window
    if not rule.has_side:
        side = older & (p_k < 0)  # no key: all False, in the inputs' array type
    else:
        side = older if rule.side is None else older & (p_k < rule.side)
    middle = older & (p_k >= rule.side) if rule.top_k else older & (p_k < 0)
    return window, side, middle


class RuleShifts:
    """A rule's position maps as shift tables over 0..m-1, grown by doubling and kept: a(p) =
    side_key(p) - p for keys, b(p) = side_query(p) - p for queries (float64; the rule's own
    torch maps, evaluated once per position instead of on every step's [B, K] array)."""

    def __init__(self, rule: DecodeRule):
        self.rule = rule
        self.a = np.empty(0, dtype=np.float64)
        self.b = np.empty(0, dtype=np.float64)

    @staticmethod
    def _grow(table: np.ndarray, m: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
        if table.shape[0] >= m:
            return table
        p = torch.arange(max(m, 2 * table.shape[0]), dtype=torch.float64)
        return (fn(p) - p).numpy()

    def key_shift(self, m: int) -> np.ndarray:
        """a(0..m-1) `[>= m]` (a longer prefix may be returned)."""
        self.a = self._grow(self.a, m, self.rule.side_key)
        return self.a

    def query_shift(self, m: int) -> np.ndarray:
        """b(0..m-1) `[>= m]`."""
        self.b = self._grow(self.b, m, self.rule.side_query)
        return self.b

    def tables(self, n_max: int) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) covering every key and query position of rows of at most `n_max` keys (a side
        key of a bounded side is below `side`)."""
        if not self.rule.has_side:
            return np.zeros(0), np.zeros(0)
        S = self.rule.side
        return self.key_shift(n_max if S is None or self.rule.top_k else min(n_max, S)), self.query_shift(n_max)


@dataclass(frozen=True)
class StepPlan:
    """Every key each row may see (module docstring). `[B, K]` each, CPU tensors."""

    keys: torch.Tensor  # int64 key positions (padding: 0)
    visible: torch.Tensor  # bool: window or side branch (the fixed-subset softmax)
    delta: torch.Tensor  # float64 re-rotation from the true position (0: window keys, padding)
    middle: torch.Tensor  # bool: top-k candidates (all False without a top-k branch)


def _n_keys(n_keys) -> np.ndarray:
    n = np.asarray(n_keys.numpy() if isinstance(n_keys, torch.Tensor) else n_keys, dtype=np.int64).reshape(-1)
    if n.size and int(n.min()) < 1:
        raise ValueError(f"n_keys must be >= 1 (a row's history includes its query), got min {int(n.min())}")
    return n


def bounded(rule: DecodeRule) -> bool:
    """Whether a row's plan has at most side + window keys (the first side, the last window)."""
    return rule.window is not None and rule.side is not None and not rule.top_k


def step_plan_ref(rule: DecodeRule, n_keys, shifts: RuleShifts | None = None) -> StepPlan:
    """The plan of rows with `n_keys [B]` keys at positions 0..n-1 (module docstring), numpy."""
    n = _n_keys(n_keys)[:, None]  # [B, 1]
    shifts = RuleShifts(rule) if shifts is None else shifts
    B, n_max = n.shape[0], int(n.max()) if n.size else 0
    if bounded(rule):
        S, W = rule.side, rule.window
        j = np.arange(min(n_max, S + W))[None]
        keys = np.where(j < S, j, j + np.maximum(n - (S + W), 0))  # [B, K]: [0, S) then the last W
    else:
        keys = np.broadcast_to(np.arange(n_max), (B, n_max))
    valid = keys < n
    p_q = n - 1
    window, side, middle = branches(rule, keys, p_q)
    visible = valid & (window | side)
    middle = valid & middle
    delta = np.zeros(keys.shape, dtype=np.float64)
    if (side & valid).any() or middle.any():
        a, b = shifts.tables(n_max)
        a_k = a[np.minimum(keys, a.shape[0] - 1)]
        delta = np.where(side & valid, a_k - b[p_q], delta)
        if rule.top_k:
            delta = np.where(middle, a_k - (rule.top_k_query - p_q), delta)
    keys = np.where(valid, keys, 0)
    return StepPlan(torch.from_numpy(np.ascontiguousarray(keys)), torch.from_numpy(visible),
                    torch.from_numpy(delta), torch.from_numpy(np.ascontiguousarray(middle)))


# ============================================================================================
# Backends
# ============================================================================================

def _ref_supports(rule: DecodeRule) -> str | None:
    return None


def _cpp_supports(rule: DecodeRule) -> str | None:
    if rule.top_k:
        return "the C++ rule_plan has no top-k branch (its keys are a fixed window + side subset)"
    from lcx.kernels.cpu import unavailable

    reason = unavailable()
    return None if reason is None else f"the C++ extension does not build here ({reason})"


def step_plan_cpp(rule: DecodeRule, n_keys, shifts: RuleShifts | None = None) -> StepPlan:
    """`step_plan_ref` by the C++ extension's `rule_plan` (one call): rows as decode requests of a
    single block each, so its slots are the positions."""
    reason = _cpp_supports(rule)
    if reason is not None:
        raise NotImplementedError(f"plan backend 'cpp' cannot run this rule: {reason}")
    from lcx.kernels.cpu import load_extension

    n = torch.from_numpy(_n_keys(n_keys))
    B = n.shape[0]
    shifts = RuleShifts(rule) if shifts is None else shifts
    n_max = int(n.max()) if B else 0
    a, b = (torch.from_numpy(t) for t in shifts.tables(n_max))
    _, _, keys, visible, delta, *_ = load_extension().rule_plan(
        torch.arange(B + 1), n, torch.zeros(B, 1, dtype=torch.int64), torch.arange(B),
        -1 if rule.window is None else rule.window, -1 if rule.side is None else rule.side,
        a, b, max(n_max, 1), 1)
    return StepPlan(keys, visible, delta, torch.zeros_like(visible))


@dataclass(frozen=True)
class PlanBackend:
    name: str
    fn: Callable[..., StepPlan]
    supports: Callable[[DecodeRule], str | None]


PLAN_BACKENDS: dict[str, PlanBackend] = {
    "ref": PlanBackend("ref", step_plan_ref, _ref_supports),
    "cpp": PlanBackend("cpp", step_plan_cpp, _cpp_supports),
}


def step_plan(rule: DecodeRule, n_keys, *, shifts: RuleShifts | None = None, backend: str = "ref") -> StepPlan:
    """The step plan of rows with `n_keys [B]` keys (module docstring) by `backend` ("ref",
    "cpp", or "auto": "cpp" where it supports the rule, else "ref"). A named backend that
    cannot run the rule raises `NotImplementedError` saying why."""
    if backend == "auto":
        backend = "cpp" if _cpp_supports(rule) is None else "ref"
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"unknown plan backend {backend!r}; known: {sorted(PLAN_BACKENDS)} or 'auto'")
    impl = PLAN_BACKENDS[backend]
    reason = impl.supports(rule)
    if reason is not None:
        raise NotImplementedError(f"plan backend {backend!r} cannot run this rule: {reason}")
    return impl.fn(rule, n_keys, shifts)


__all__ = ["PLAN_BACKENDS", "PlanBackend", "RuleShifts", "StepPlan", "bounded", "branches", "step_plan",
           "step_plan_cpp", "step_plan_ref"]
