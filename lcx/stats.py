"""Interval statistics for accuracies measured on a few prompts (one place; reports and studies use it).

- `wilson_interval(k, n)`: Wilson score interval of a proportion (stays in [0, 1], not degenerate
  at 0/n or n/n: the right one for passkey accuracies on 4-30 prompts).
- `paired_difference(x, y)`: the difference of two proportions measured on the SAME samples (two
  methods on the same passkey prompts), Newcombe's paired interval and the exact McNemar p;
  `all_pairs(outcomes)` runs it for every pair of named outcome maps.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a proportion k/n (None when n == 0). Unlike the normal
    interval it stays inside [0, 1] and is not degenerate at 0/n or n/n, which matters for
    accuracies near 0 on ~100 samples."""
    if n <= 0:
        return None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (max(0.0, min(p, c - h)), min(1.0, max(p, c + h)))  # contains p (rounding at 0/n, n/n)


def all_pairs(outcomes: Sequence[tuple[str, Mapping[Any, bool]]]) -> list[dict[str, Any]]:
    """`paired_difference` for every pair (a, b) of named outcome maps, a listed before b, over the
    keys both hold (the same prompts); pairs with no shared key are left out."""
    pairs = []
    for i, (a, x) in enumerate(outcomes):
        for b, y in outcomes[i + 1:]:
            keys = sorted(set(x) & set(y))
            if keys:
                pairs.append({"a": a, "b": b, **paired_difference([x[k] for k in keys], [y[k] for k in keys])})
    return pairs


def paired_difference(x: Sequence[bool], y: Sequence[bool], z: float = Z95) -> dict[str, Any]:
    """Difference of two proportions measured on the same samples, `mean(x) - mean(y)`, with
    Newcombe's hybrid score interval for paired data (Newcombe 1998, method 10: Wilson
    intervals of both margins, combined with the pairs' phi correlation, continuity-corrected) and the exact
    two-sided McNemar p-value (binomial test on the discordant pairs). `x_only` / `y_only` count
    the samples only x / only y got right."""
    if len(x) != len(y):
        raise ValueError(f"paired samples differ in length: {len(x)} vs {len(y)}")
    n = len(x)
    a = sum(1 for u, v in zip(x, y) if u and v)
    b = sum(1 for u, v in zip(x, y) if u and not v)
    c = sum(1 for u, v in zip(x, y) if v and not u)
    d = n - a - b - c
    out: dict[str, Any] = {"n": n, "x_only": b, "y_only": c, "both": a, "neither": d,
                           "diff": None, "ci95": None, "mcnemar_p": None}
    if n == 0:
        return out
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, z)
    l2, u2 = wilson_interval(a + c, n, z)
    # phi with Newcombe's correction: ad - bc shrunk by n/2 towards 0 when positive, kept when negative
    den = (a + b) * (c + d) * (a + c) * (b + d)
    cov = a * d - b * c
    cov = cov - n / 2 if cov > n / 2 else min(cov, 0)
    phi = cov / math.sqrt(den) if den else 0.0
    delta = p1 - p2
    lo = delta - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = delta + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    m = b + c  # exact McNemar: P(X <= min(b, c)) * 2 for X ~ Binomial(m, 1/2)
    p = 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, i) for i in range(min(b, c) + 1)) / 2 ** m)
    out.update(diff=delta, ci95=[max(-1.0, lo), min(1.0, hi)], mcnemar_p=p)
    return out

__all__ = ["Z95", "paired_difference", "wilson_interval"]
