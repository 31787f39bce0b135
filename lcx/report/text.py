"""Text of `lcx report`'s tables shared by the passkey and RULER sections: an interval, a signed
difference, a p-value, a stored pair read in either order."""

from __future__ import annotations

from typing import Any


def oriented(pairs: list[dict[str, Any]], a: str, b: str) -> dict[str, Any] | None:
    """The pair (a, b) of `passkey_paired` rows as a - b (flipped when stored as (b, a))."""
    for p in pairs:
        if (p["a"], p["b"]) == (a, b):
            return p
        if (p["a"], p["b"]) == (b, a):
            ci = p["ci95"]
            return {**p, "a": a, "b": b, "x_only": p["y_only"], "y_only": p["x_only"],
                    "diff": None if p["diff"] is None else -p["diff"], "ci95": None if ci is None else [-ci[1], -ci[0]]}
    return None


def signed(x: float) -> str:
    return f"{round(x, 2) + 0.0:+.2f}"  # (+ 0.0: no "-0.00")


def p_text(p: float | None) -> str:
    return "—" if p is None else ("<0.001" if p < 0.001 else f"{p:.3f}")


def p_is(p: float | None) -> str:
    """`p=0.004`, `p<0.001`."""
    text = p_text(p)
    return "p" + text if text.startswith("<") else "p=" + text


def format_interval(iv: dict[str, Any] | None) -> str:
    """`0.75 [0.30, 0.95] n=4` (accuracy, Wilson 95% interval, prompts); — when not measured."""
    return "—" if iv is None else f"{iv['acc']:.2f} [{iv['lo']:.2f}, {iv['hi']:.2f}] n={iv['n']}"
