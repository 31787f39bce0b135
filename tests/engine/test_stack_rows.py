"""`lcx.engine.prefix.stack_rows`: rows' held keys left-padded into one batch, each element written
once (a row's keys or zeros on its padding); rows of one length stacked without padding. Equal, bit
for bit, to zeros with every row copied in."""

from __future__ import annotations

import pytest
import torch

from lcx.engine.prefix import RowKV, stack_rows


def _row(n: int, g: torch.Generator, layers: int = 3) -> RowKV | None:
    if n < 0:
        return None
    return RowKV([torch.randn(2, n, 4, generator=g) for _ in range(layers)],
                 [torch.randn(2, n, 5, generator=g) for _ in range(layers)], torch.arange(3, 3 + n))


@pytest.mark.parametrize("lengths", [[7, 7, 7], [5, 9, 1], [6, -1, 6], [0, 4], [3, 0, 3], [11, 11]])
def test_stack_rows_is_zeros_with_every_row_copied_in(lengths):
    g = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    rows = [_row(n, g) for n in lengths]
    keys, values, pos = stack_rows(rows, 3, None)
    N = max(max(lengths), 0)
    assert pos.shape == (len(rows), N)
    for layer in range(3):
        want_k, want_v = torch.zeros(len(rows), 2, N, 4), torch.zeros(len(rows), 2, N, 5)
        for i, r in enumerate(rows):
            if r is not None and r.slots:
                want_k[i, :, N - r.slots:] = r.k[layer]
                want_v[i, :, N - r.slots:] = r.v[layer]
                assert pos[i, N - r.slots:].tolist() == r.pos.tolist() and bool((pos[i, :N - r.slots] == -1).all())
            else:
                assert bool((pos[i] == -1).all())
        assert torch.equal(keys[layer], want_k) and torch.equal(values[layer], want_v)


def test_nothing_held_and_one_row():
    g = torch.Generator().manual_seed(0)
    assert stack_rows([None, _row(0, g)], 3, None)[0] is None
    r = _row(5, g)
    keys, _, pos = stack_rows([r], 3, None)
    assert keys[0].shape == (1, 2, 5, 4) and keys[0].data_ptr() == r.k[0].data_ptr()  # a view, no copy


@pytest.mark.parametrize("lengths", [[7, 7, 7], [5, 9, 1], [4]])
def test_room_for_the_new_keys(lengths):
    """`room`: buffers of N + room slots, the rows as without room in the first N (one row copied
    too: a view has no room), the last `room` left for the step's new keys."""
    g = torch.Generator().manual_seed(len(lengths))
    rows = [_row(n, g) for n in lengths]
    keys, values, pos = stack_rows(rows, 3, None)
    roomy_k, roomy_v, roomy_pos = stack_rows(rows, 3, None, room=6)
    N = max(lengths)
    assert torch.equal(roomy_pos, pos)
    for layer in range(3):
        assert roomy_k[layer].shape == (len(rows), 2, N + 6, 4)
        assert torch.equal(roomy_k[layer][:, :, :N], keys[layer]) and torch.equal(roomy_v[layer][:, :, :N], values[layer])
        assert roomy_k[layer].data_ptr() != rows[0].k[layer].data_ptr()
