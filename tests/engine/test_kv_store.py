"""`lcx.engine.kv`: the decode step over a cache of keys rotated once equals the method's own
`attend` over the unrotated history, row by row, for every method with a decode rule: ragged
batches (rows of different lengths), many steps (rings wrapping), an attention factor != 1.
Also the store's bookkeeping: bounded rings never grow, rows leave and join."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lcx.attention import Rotary
from lcx.engine.kv import CacheLayout, DecodeStep, KVStore, drop_order
from lcx.methods import examples, lm_infinite, method_id

B_LENS = (1, 6, 13)  # prompt lengths of the rows (odd; the first no longer than any window)
STEPS = 11  # decode steps: rows run past every window below
H, HKV, D = 4, 2, 8
# every registered method's examples with a decode rule (not SWAT): windows of a few keys, and
# LM-Infinite's top-k middle keys in layer 0 (the middle reaches k keys after some steps) and
# from layer 1 (not in this layer: plain Λ over a cache of every key)
METHODS = [m for m in examples() if m.decode_rule() is not None]


class _Attn(nn.Module):
    """The parts of an HF attention module a decode step uses."""

    def __init__(self, hidden: int, g: torch.Generator):
        super().__init__()
        self.head_dim, self.layer_idx, self.scaling = D, 0, D ** -0.5
        self.q_proj, self.k_proj = nn.Linear(hidden, H * D, bias=False), nn.Linear(hidden, HKV * D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, HKV * D, bias=False), nn.Linear(H * D, hidden, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g, dtype=torch.float64) * 0.3


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_decode_steps_equal_attend(method):
    g = torch.Generator().manual_seed(7)
    hidden = 12
    attn = _Attn(hidden, g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    basis = (inv_freq, 1.3)
    layout = CacheLayout.for_method(method, basis=basis)
    assert layout.rotated
    # the rows' histories: unrotated keys/values as a patched model's prefill leaves them
    T = max(B_LENS)
    hist_h = [torch.randn(n, hidden, generator=g, dtype=torch.float64) for n in B_LENS]
    keys = torch.zeros(len(B_LENS), HKV, T, D, dtype=torch.float64)
    values = torch.zeros_like(keys)
    pos = torch.full((len(B_LENS), T), -1)
    for b, h in enumerate(hist_h):
        n = h.shape[0]
        keys[b, :, T - n:] = attn.k_proj(h).view(n, HKV, D).transpose(0, 1)
        values[b, :, T - n:] = attn.v_proj(h).view(n, HKV, D).transpose(0, 1)
        pos[b, T - n:] = torch.arange(n)
    budget = torch.tensor([n + STEPS for n in B_LENS])
    store = KVStore.from_prefill(layout, [keys], [values], pos, budget)
    slots0 = store.slots
    for step in range(STEPS):
        h_new = torch.randn(len(B_LENS), 1, hidden, generator=g, dtype=torch.float64)
        p_q = torch.tensor([n + step for n in B_LENS])
        with torch.no_grad():
            qn, kn, vn = (proj(h_new).view(len(B_LENS), 1, -1, D) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = DecodeStep.build(store, p_q, torch.float64).attend(attn, qn, kn, vn)  # [B, 1, H, D]
            got = attn.o_proj(out.reshape(len(B_LENS), 1, -1))  # [B, 1, hidden]
        for b in range(len(B_LENS)):
            hist_h[b] = torch.cat([hist_h[b], h_new[b]])
            hb = hist_h[b]
            n = hb.shape[0]
            q = attn.q_proj(hb[-1:]).view(1, 1, H, D)
            k = attn.k_proj(hb).view(1, n, HKV, D)
            v = attn.v_proj(hb).view(1, n, HKV, D)
            with torch.no_grad():
                ref = method.attend(q, k, v, rotary=Rotary(inv_freq, torch.arange(n), 1.3), scale=attn.scaling,
                                    layer_idx=0)
                want = attn.o_proj(ref.reshape(1, 1, -1))
            torch.testing.assert_close(got[b], want[0], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"row {b} (length {n}) step {step}: {m}")
        if layout.window is not None and layout.side is not None:
            assert store.slots == slots0  # a bounded store never grows
            assert int(store.held().max()) <= layout.window + layout.side


def test_rows_leave_and_join():
    method = lm_infinite(2, 4)
    layout = CacheLayout.for_method(method, basis=(torch.ones(D // 2, dtype=torch.float64), 1.0))
    k = torch.randn(2, HKV, 9, D)
    pos = torch.tensor([[-1] * 4 + list(range(5)), list(range(9))])
    a = KVStore.from_prefill(layout, [k], [k.clone()], pos, torch.tensor([20, 20]))
    # a ring of 4, slot p % 4: the next query (at 5, resp. 9) sees the 3 keys before it, and
    # its own key goes into the free slot
    assert a.main.pos.tolist() == [[4, -1, 2, 3], [8, -1, 6, 7]]
    assert a.side.pos.tolist() == [[0, 1], [0, 1]]
    b = a.rows([1])
    assert b.batch == 1 and b.main.pos.tolist() == [[8, -1, 6, 7]]
    c = KVStore.cat([b, a])
    assert c.batch == 3 and c.slots == a.slots
    torch.testing.assert_close(c.main.k[0][0], a.main.k[0][1])


def test_unbounded_store_grows_within_budget():
    layout = CacheLayout.unpatched()
    k = torch.randn(1, HKV, 5, D)
    store = KVStore.from_prefill(layout, [k], [k.clone()], torch.arange(5)[None], torch.tensor([7]))
    assert store.main.capacity == 7  # 2 x 5 capped at the budget
    store.step(torch.tensor([5]))
    store.step(torch.tensor([6]))
    assert store.main.capacity == 7 and store.main.pos.tolist() == [list(range(7))]


def test_unbounded_rows_free_what_the_long_row_held():
    layout = CacheLayout.unpatched()
    k = torch.randn(2, HKV, 9, D)
    pos = torch.tensor([[-1] * 6 + list(range(3)), list(range(9))])
    store = KVStore.from_prefill(layout, [k], [k.clone()], pos, torch.tensor([40, 40]))
    assert store.main.capacity == 18
    short = store.rows([0])
    assert short.main.capacity == 3 and short.nbytes() < store.nbytes() / 5
    torch.testing.assert_close(short.main.k[0][0], k[0, :, 6:])


def test_top_k_ties_go_to_the_earlier_key():
    """LM-Infinite's top-k middle keys with every score tied (a query of zeros, as a token whose
    embedding is zero makes): the decode step picks the same keys as the reference, the earliest
    (`lcx.attention.reference.top_k_indices`); torch.topk would leave the choice unspecified."""
    from lcx.attention.reference import top_k_indices

    assert top_k_indices(torch.tensor([[0.0, 2.0, 0.0, 0.0, 2.0]]), 3).tolist() == [[1, 4, 0]]
    method = lm_infinite(1, 3, limit_distance=2, top_k=3, top_k_from_layer=0, top_k_insert_at=5)
    g = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    layout = CacheLayout.for_method(method, basis=(inv_freq, 1.0))
    n = 12
    k = torch.randn(1, HKV, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, HKV, n, D, generator=g, dtype=torch.float64)
    store = KVStore.from_prefill(layout, [k], [v], torch.arange(n)[None], torch.tensor([n + 1]))
    attn = _Attn(12, g)
    q = torch.zeros(1, 1, H, D, dtype=torch.float64)  # every middle key scores 0
    kn = torch.randn(1, 1, HKV, D, generator=g, dtype=torch.float64)
    vn = torch.randn(1, 1, HKV, D, generator=g, dtype=torch.float64)
    got = DecodeStep.build(store, torch.tensor([n]), torch.float64).attend(attn, q, kn, vn)
    kk, vv = torch.cat([k.transpose(1, 2), kn], 1), torch.cat([v.transpose(1, 2), vn], 1)  # [1, n + 1, Hkv, D]
    want = method.attend(q, kk, vv, rotary=Rotary(inv_freq, torch.arange(n + 1), 1.0), scale=attn.scaling,
                         layer_idx=0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and the chosen keys matter: the latest three middle keys instead give another output
    late = method.attend(q, torch.cat([kk[:, :1], kk[:, 1:10].flip(1), kk[:, 10:]], 1),
                         torch.cat([vv[:, :1], vv[:, 1:10].flip(1), vv[:, 10:]], 1),
                         rotary=Rotary(inv_freq, torch.arange(n + 1), 1.0), scale=attn.scaling, layer_idx=0)
    assert (late - want).abs().max() > 1e-3


def test_drop_order_fills_holes_from_the_end():
    assert drop_order(5, [0]) == (4, [0], [4], [4, 1, 2, 3])
    assert drop_order(5, [4]) == (4, [], [], [0, 1, 2, 3])  # the last row: nothing moves
    assert drop_order(7, [1, 5, 2]) == (4, [1, 2], [4, 6], [0, 4, 6, 3])  # 5 dropped: 6 fills a hole
    assert drop_order(3, [0, 1, 2]) == (0, [], [], [])


def _pair(layout, seed: int, lens: tuple[int, ...], budget: int) -> KVStore:
    g = torch.Generator().manual_seed(seed)
    T = max(lens)
    k, v = (torch.randn(len(lens), HKV, T, D, generator=g) for _ in range(2))
    pos = torch.tensor([[-1] * (T - n) + list(range(n)) for n in lens])
    return KVStore.from_prefill(layout, [k, k * 2], [v, v * 2], pos, torch.tensor([budget] * len(lens)))


def _same(a: KVStore, b: KVStore) -> None:
    """Equal held keys: positions, and keys/values in every slot that holds one (`b` may have more slots)."""
    for x, y in ((a.main, b.main), (a.side, b.side)) if a.side is not None else ((a.main, b.main),):
        C = x.capacity
        assert torch.equal(x.pos, y.pos[:, :C]) and bool((y.pos[:, C:] == -1).all())
        for s, t in zip((*x.k, *x.v), (*y.k, *y.v)):
            assert torch.equal(s, t[:, :, :C]) and bool((t[:, :, C:] == 0).all())
    assert torch.equal(a.budget, b.budget)


@pytest.mark.parametrize("layout", [CacheLayout.for_method(lm_infinite(2, 4), basis=(torch.ones(D // 2, dtype=torch.float64), 1.0)),
                                    CacheLayout.unpatched()], ids=["ring+side", "unbounded"])
def test_rows_join_and_leave_in_place_as_the_copies_do(layout):
    """`append` and `move` (what the engine runs) hold what `cat` and `rows` (copies) hold, row
    for row, through joins, leaves and a reused row; spare rows are kept, then given back."""
    first, later = _pair(layout, 0, (3, 7, 5), 20), _pair(layout, 1, (11, 2), 30)  # later: more slots
    store = first.rows([0, 1, 2])
    store.append(later)
    want = KVStore.cat([first, later])
    _same(want, store)
    n, dst, src, order = drop_order(store.batch, [0, 2])
    store.move(dst, src, n)
    want = want.rows(order)  # (copies keep only the slots up to the newest key: compare on theirs)
    _same(want, store)
    assert store.main.spare_rows >= 2  # the dropped rows' buffers stay for the next to join
    third = _pair(layout, 2, (1,), 9)
    store.append(third)  # into a row that held another request: its old keys must not show
    want = KVStore.cat([want, third])
    _same(want, store)
    n, dst, src, order = drop_order(store.batch, [0, 1, 3])
    store.move(dst, src, n)  # 1 of 7 buffer rows left: the buffers shrink to it
    assert store.batch == 1 and store.main.spare_rows == 0 and order == [2]
    _same(want.rows(order), store)


@pytest.mark.parametrize("layout", [CacheLayout.for_method(lm_infinite(2, 4), basis=(torch.ones(D // 2, dtype=torch.float64), 1.0)),
                                    CacheLayout.unpatched()], ids=["ring+side", "unbounded"])
def test_prefill_rows_written_into_spare_rows_as_appended(layout):
    """`from_prefill(..., into=store)` (the engine's join when the store has room: the rows
    written in place, no new buffers) holds what `from_prefill` + `append` hold, also into a row
    that held another request and into an emptied (parked) store; without room it is a new store."""
    first = _pair(layout, 0, (3, 7, 5), 30)
    store = _pair(layout, 0, (3, 7, 5), 30)
    store.append(_pair(layout, 5, (4,), 30))  # the buffers grow with spare rows
    n, dst, src, _ = drop_order(store.batch, [1, 3])
    store.move(dst, src, n)
    g = torch.Generator().manual_seed(1)
    pos = _pos([list(range(6)), list(range(2))], 6)
    k, v = torch.randn(2, HKV, 6, D, generator=g), torch.randn(2, HKV, 6, D, generator=g)
    ks, vs, budget = [k, k * 2], [v, v * 2], torch.tensor([20, 20])
    want = KVStore.cat([store.rows(list(range(store.batch))), KVStore.from_prefill(layout, ks, vs, pos, budget)])
    assert store.main.spare_rows >= 2
    got = KVStore.from_prefill(layout, ks, vs, pos, budget, into=store)
    assert got is store and store.batch == 4
    _same(want, store)
    n, dst, src, _ = drop_order(store.batch, [0, 1, 2, 3])
    store.move(dst, src, n)  # emptied: its buffers are kept (the engine parks them)
    assert store.batch == 0 and store.main.spare_rows >= 2
    room = store.has_room(layout, 2, KVStore._plan(layout, pos, budget))
    again = KVStore.from_prefill(layout, ks, vs, pos, budget, into=store)
    assert room and again is store
    _same(KVStore.from_prefill(layout, ks, vs, pos, budget), again)
    full = KVStore.from_prefill(layout, ks, vs, pos, budget, into=first)  # no spare rows
    assert full is not first and first.batch == 3


def _pos(rows: list[list[int]], T: int) -> torch.Tensor:
    """Left-padded slot positions `[b, T]` (-1: padding) of rows given as position lists."""
    out = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, T - len(r):] = torch.tensor(r)
    return out


SCATTER_CASES = {  # (rows' kept positions, ring, C)
    "uniform": ([list(range(11))] * 3, None, 16),
    "uniform, continued": ([list(range(5, 16))] * 2, None, 20),
    "left-padded": ([list(range(11)), list(range(4)), list(range(7))], None, 16),
    "continued": ([list(range(5, 16)), list(range(9)), []], None, 20),
    "a gap": ([list(range(3)) + list(range(9, 15)), list(range(9))], None, 16),  # a bounded row's kept keys
    "ring, no wrap": ([list(range(1, 8))] * 2, 8, 8),
    "ring, wrapping": ([list(range(5, 12)), list(range(4))], 8, 8),
}


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("case", list(SCATTER_CASES))
def test_prefill_rows_move_as_slices_or_gathered_alike(case, rotate, monkeypatch):
    """`_scatter` moves rows that keep the same run of slots as one slice (`_one_run`) and any
    others by gathering: the same store either way, bit for bit."""
    import lcx.engine.kv as kv

    rows, ring, C = SCATTER_CASES[case]
    T = max(len(r) for r in rows) + 2  # (every row left-padded by at least 2)
    pos = _pos(rows, T)
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(len(rows), 2, T, 4, generator=g) for _ in range(2)]
    values = [torch.randn(len(rows), 2, T, 4, generator=g) for _ in range(2)]
    rotation = (lambda x, p: x * (1.0 + p.to(x.dtype))[:, None, None]) if rotate else None
    sliced = case in ("uniform", "uniform, continued", "ring, no wrap")
    assert (kv._one_run(pos, pos >= 0, ring, C) is not None) == sliced
    fast = kv._scatter(keys, values, pos, pos >= 0, C, ring, None, rotation)
    monkeypatch.setattr(kv, "_one_run", lambda *a: None)
    slow = kv._scatter(keys, values, pos, pos >= 0, C, ring, None, rotation)
    assert torch.equal(fast.pos, slow.pos)
    for a, b in zip(fast.k + fast.v, slow.k + slow.v):
        assert torch.equal(a, b)
