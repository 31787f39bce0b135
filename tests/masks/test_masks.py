"""Masks: hand-written expected matrices pin the window convention of `lcx.masks`.

Matrices are written as text: one row per query (the LAST Tq of the Tk positions), one
column per key, `x` = visible, `.` = masked.
"""

from __future__ import annotations

import pytest
import torch

from lcx.masks import (
    MASKS,
    KeySpan,
    and_masks,
    attention_sinks,
    causal,
    causal_mask,
    global_tokens,
    lambda_mask,
    make_mask,
    mask_matrix,
    mask_span,
    not_mask,
    or_masks,
    sliding_window,
)

# Example parameters for every registry entry; a new mask must add its own here.
EXAMPLE_PARAMS = {
    "causal": [{}],
    "sliding_window": [{"left": 0}, {"left": 2}, {"left": 7}],
    "global_tokens": [{"n": 0}, {"n": 3}],
    "attention_sinks": [{"n_sink": 1, "left": 1}, {"n_sink": 4, "left": 7}],
    "lambda": [{"n_global": 0, "n_local": 1}, {"n_global": 2, "n_local": 2}, {"n_global": 4, "n_local": 16}],
}
# (Tq, Tk, q_offset): prefill, chunked prefill, decode, odd sizes, explicit offset.
SHAPES = [(1, 1, None), (9, 9, None), (5, 17, None), (1, 17, None), (63, 63, None), (4, 30, 10)]


def grid(text: str) -> torch.Tensor:
    rows = [r.split() for r in text.strip().splitlines()]
    return torch.tensor([[c == "x" for c in r] for r in rows], dtype=torch.bool)


def show(m: torch.Tensor) -> str:
    return "\n".join(" ".join("x" if b else "." for b in row) for row in m.tolist())


def check(mask, tq, tk, expected: str, q_offset=None):
    got = mask_matrix(mask, tq, tk, q_offset=q_offset)
    want = grid(expected)
    assert got.shape == want.shape and torch.equal(got, want), f"{mask.__name__}:\n{show(got)}"


# ------------------------------------------------------------------ expected matrices
def test_causal_prefill_chunk_decode():
    check(causal_mask, 4, 4, """
        x . . .
        x x . .
        x x x .
        x x x x
    """)  # fmt: skip
    check(causal_mask, 2, 5, """
        x x x x .
        x x x x x
    """)  # fmt: skip
    check(causal_mask, 1, 5, "x x x x x")


def test_sliding_window_prefill_chunk_decode():
    check(sliding_window(left=2), 5, 5, """
        x . . . .
        x x . . .
        x x x . .
        . x x x .
        . . x x x
    """)  # fmt: skip
    check(sliding_window(left=2), 3, 6, """
        . x x x . .
        . . x x x .
        . . . x x x
    """)  # fmt: skip  (the diagram in lcx.masks)
    check(sliding_window(left=2), 1, 6, ". . . x x x")
    check(sliding_window(left=0), 3, 3, """
        x . .
        . x .
        . . x
    """)  # fmt: skip


def test_global_tokens():
    check(global_tokens(2), 4, 4, """
        x . . .
        x x . .
        x x . .
        x x . .
    """)  # fmt: skip
    check(global_tokens(2), 1, 4, "x x . .")


def test_attention_sinks_prefill_chunk_decode():
    check(attention_sinks(1, 1), 5, 5, """
        x . . . .
        x x . . .
        x x x . .
        x . x x .
        x . . x x
    """)  # fmt: skip
    check(attention_sinks(1, 1), 2, 5, """
        x . x x .
        x . . x x
    """)  # fmt: skip
    check(attention_sinks(1, 1), 1, 5, "x . . x x")


def test_lambda_mask_prefill_chunk_decode():
    check(lambda_mask(2, 2), 6, 6, """
        x . . . . .
        x x . . . .
        x x x . . .
        x x x x . .
        x x . x x .
        x x . . x x
    """)  # fmt: skip  (the diagram in lcx.masks)
    check(lambda_mask(2, 2), 2, 6, """
        x x . x x .
        x x . . x x
    """)  # fmt: skip
    check(lambda_mask(2, 2), 1, 6, "x x . . x x")
    check(lambda_mask(2, 3), 1, 7, "x x . . x x x")


def test_explicit_q_offset():
    # queries at indices 1 and 2 of 5 keys (not the last ones)
    check(sliding_window(left=1), 2, 5, """
        x x . . .
        . x x . .
    """, q_offset=1)  # fmt: skip


# ------------------------------------------------------------------ names, registry, algebra
def test_names_record_parameters():
    assert causal_mask.__name__ == "causal"
    assert sliding_window(left=7).__name__ == "sliding_window_7"
    assert global_tokens(3).__name__ == "global_tokens_3"
    assert attention_sinks(4, 7).__name__ == "attention_sinks_4_7"
    assert lambda_mask(4, 16).__name__ == "lambda_4_16"
    m = and_masks(global_tokens(4), not_mask(sliding_window(left=7)))
    assert m.__name__ == "and(global_tokens_4,not(sliding_window_7))"
    assert or_masks(causal_mask, sliding_window(left=1)).__name__ == "or(causal,sliding_window_1)"


def test_registry_examples_cover_every_mask():
    assert set(EXAMPLE_PARAMS) == set(MASKS), "add example params for new masks"
    for name, examples in EXAMPLE_PARAMS.items():
        for params in examples:
            m = make_mask(name, **params)
            assert callable(m) and m.__name__
            for value in params.values():
                assert str(value) in m.__name__, (name, params, m.__name__)
    assert make_mask("causal") is causal() is causal_mask


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks_are_causal_and_span_is_a_superset(name):
    """Every registry mask hides the future, and its KeySpan covers every visible key."""
    for params in EXAMPLE_PARAMS[name]:
        m = make_mask(name, **params)
        span = mask_span(m)
        assert span is not None, f"{m.__name__} has no span: blockwise would read every key"
        for tq, tk, off in SHAPES:
            vis = mask_matrix(m, tq, tk, q_offset=off)
            o = tk - tq if off is None else off
            i = torch.arange(o, o + tq)[:, None]
            j = torch.arange(tk)[None, :]
            assert not (vis & (j > i)).any(), f"{m.__name__} sees the future"
            left = tk if span.left is None else span.left
            in_span = (j < span.n_global) | ((j <= i) & (i - j <= left))
            assert not (vis & ~in_span).any(), f"{m.__name__}: visible keys outside {span}"
            # key_ranges over a block of queries covers the same keys, without duplicates
            covered = torch.zeros(tk, dtype=torch.bool)
            for lo, hi in span.key_ranges(o, o + tq, tk):
                assert not covered[lo:hi].any()
                covered[lo:hi] = True
            assert not (vis.any(0) & ~covered).any()


def test_sinks_equal_lambda_mask():
    for tq, tk, off in SHAPES:
        a = mask_matrix(attention_sinks(3, 4), tq, tk, q_offset=off)
        b = mask_matrix(lambda_mask(3, 5), tq, tk, q_offset=off)
        assert torch.equal(a, b)


def test_and_or_not_semantics():
    a, b = sliding_window(left=3), global_tokens(2)
    A, Bm = mask_matrix(a, 9, 9), mask_matrix(b, 9, 9)
    assert torch.equal(mask_matrix(and_masks(a, b), 9, 9), A & Bm)
    assert torch.equal(mask_matrix(or_masks(a, b), 9, 9), A | Bm)
    assert torch.equal(mask_matrix(not_mask(a), 9, 9), ~A)
    assert mask_span(not_mask(a)) is None
    assert mask_span(and_masks(not_mask(a), b)) == KeySpan(2, -1)
    assert mask_span(or_masks(a, b)) == KeySpan(2, 3)
    assert mask_matrix(None, 2, 3).all()


def test_key_ranges_hand_written():
    span = KeySpan(n_global=4, left=15)
    assert span.key_ranges(100, 228, 300) == [(0, 4), (85, 228)]
    assert span.key_ranges(0, 128, 50) == [(0, 50)]  # window starts at 0: no separate globals
    assert span.key_ranges(10, 20, 300) == [(0, 20)]
    assert KeySpan(0, None).key_ranges(40, 50, 60) == [(0, 50)]
    # blockwise memory: a block of 128 queries reads at most G + 128 + left keys
    for i0 in range(0, 5000, 128):
        n = sum(hi - lo for lo, hi in span.key_ranges(i0, i0 + 128, 5000))
        assert n <= 4 + 128 + 15


@pytest.mark.parametrize(
    "bad",
    [lambda: sliding_window(left=-1), lambda: sliding_window(left=True), lambda: sliding_window(left=2.0),
     lambda: lambda_mask(2, 0), lambda: global_tokens(-3), lambda: make_mask("nope"),
     lambda: make_mask("sliding_window", right=3), lambda: mask_matrix(causal_mask, 3, 2)],
    ids=["negative", "bool", "float", "lambda_no_window", "negative_n", "unknown", "bad_key", "tq_gt_tk"],
)  # fmt: skip
def test_bad_values_raise(bad):
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("name", sorted(MASKS))
def test_flex_block_mask_agrees(name):
    """Masks are vmap-safe: flex_attention's dense mask equals mask_matrix."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    for params in EXAMPLE_PARAMS[name]:
        m = make_mask(name, **params)
        dense = fa.create_mask(m, None, None, 37, 37, device="cpu")[0, 0]
        assert torch.equal(dense, mask_matrix(m, 37, 37))


def test_window_shape_is_data_on_the_primitives_only():
    """Backends read a mask's structure through `window_shape`, never its name: the primitives
    carry their exact (n_global, left); composed or hand-named masks carry none, even when their
    name looks like a primitive's."""
    from lcx.masks import (KeySpan, and_masks, attention_sinks, causal, global_tokens, lambda_mask, or_masks,
                           sliding_window, window_shape)
    from lcx.masks.base import named

    assert window_shape(causal()) == KeySpan(0, None)
    assert window_shape(sliding_window(left=7)) == KeySpan(0, 7)
    assert window_shape(global_tokens(3)) == KeySpan(3, -1)
    assert window_shape(attention_sinks(4, 7)) == KeySpan(4, 7)
    assert window_shape(lambda_mask(2, 16)) == KeySpan(2, 15)
    assert window_shape(or_masks(global_tokens(2), sliding_window(left=15))) is None  # same keys, not declared
    assert window_shape(and_masks(sliding_window(left=3), causal())) is None
    assert window_shape(named(lambda b, h, i, j: j <= i, "sliding_window_3", None, {"left": 3})) is None
    assert window_shape(None) is None
