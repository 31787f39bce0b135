"""The rows of one KV store (`lcx.engine.kv`): per-layer keys/values `[B, Hkv, C, D]` and slot
positions `[B, C]`, held as the first B rows of buffers that may hold more, so that a request
joining the running batch and one leaving it copy only their own rows (`SlotStore.append`,
`SlotStore.move` with `drop_order`), never the whole batch's cache."""

from __future__ import annotations

import torch


def rebuffer(x: torch.Tensor, R: int, C: int, n: int, fill: float | int = 0) -> torch.Tensor:
    """A buffer of R rows and C slots holding x's first n rows (x `[>= n, ..., C0]`, C0 <= C),
    their new slots `fill` (zeros for keys and values, so an empty slot is never NaN; -1 for
    positions). Spare rows (n..R) of keys and values are left unwritten: a row is written whole
    when it joins (`SlotStore.append`), so nothing reads them before; spare rows of positions
    (`[R, C]`, small) are `fill`. Writing only the live rows' memory, not the whole new buffer
    twice, spares a resize most of its page faults (fresh pages are touched as rows join)."""
    dim = 2 if x.dim() == 4 else 1
    shape = list(x.shape)
    shape[0], shape[dim] = R, C
    c0 = x.shape[dim]
    if dim == 1:  # positions
        out = x.new_full(shape, fill)
        out[:n, :c0] = x[:n]
        return out
    out = x.new_empty(shape)
    out[:n, :, :c0] = x[:n]
    if c0 < C:
        out[:n, :, c0:] = fill
    return out


class SlotStore:
    """One store: per-layer keys/values `[B, Hkv, C, D]` and slot positions `[B, C]` (-1: empty).

    The B rows are the first B of buffers that may hold more (`R` rows): a request joining the
    running batch is copied into a spare row (`append`) and a finished one is closed up by moving
    only the rows after it (`keep`), so neither copies the whole batch's cache, as vLLM's paged KV
    cache never does either. `k`, `v`, `pos` are views of the live rows."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], pos: torch.Tensor, ring: int | None,
                 limit: int | None):
        self.ring = ring  # ring size (bounded main store), else None: slot = position
        self.limit = limit  # keep only positions < limit (bounded side store), else None
        self._set(k, v, pos, int(pos.shape[0]))

    def _set(self, kb: list[torch.Tensor], vb: list[torch.Tensor], pb: torch.Tensor, n: int) -> None:
        self._kb, self._vb, self._pb, self.n = kb, vb, pb, n
        self.k = [t[:n] for t in kb]
        self.v = [t[:n] for t in vb]
        self.pos = pb[:n]

    @property
    def capacity(self) -> int:
        return int(self._pb.shape[1])

    @property
    def spare_rows(self) -> int:
        return int(self._pb.shape[0]) - self.n

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def slot(self, p: torch.Tensor) -> torch.Tensor:
        return p % self.ring if self.ring is not None else p

    def _resize(self, R: int, C: int) -> None:
        n = self.n
        self._set([rebuffer(t, R, C, n) for t in self._kb], [rebuffer(t, R, C, n) for t in self._vb],
                  rebuffer(self._pb, R, C, n, -1), n)

    def spare(self, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Views of the next b spare rows' keys, values (per layer `[b, Hkv, C, D]`) and positions
        `[b, C]`, for a caller that writes whole rows there, then `grow_rows(b)`."""
        n = self.n
        return [t[n:n + b] for t in self._kb], [t[n:n + b] for t in self._vb], self._pb[n:n + b]

    def grow_rows(self, b: int) -> None:
        """The next b spare rows, written whole (`spare`), join the live rows."""
        if b > self.spare_rows:
            raise ValueError(f"{b} rows joining a store with {self.spare_rows} spare rows")
        self._set(self._kb, self._vb, self._pb, self.n + b)

    def grow(self, C: int) -> None:
        if C > self.capacity:
            self._resize(int(self._pb.shape[0]), C)

    def append(self, other: "SlotStore") -> None:
        """Add `other`'s rows after this store's (in place; buffers reallocated only when the rows
        or the slots run out: then with room for half as many rows again)."""
        n, m, Co = self.n, other.n, other.capacity
        if m > self.spare_rows or Co > self.capacity:
            R = max(n + m, int(self._pb.shape[0])) if m <= self.spare_rows else n + m + (n + m) // 2
            self._resize(R, max(Co, self.capacity))
        for dst, src in zip((*self._kb, *self._vb), (*other.k, *other.v)):
            dst[n:n + m, :, :Co] = src
            dst[n:n + m, :, Co:] = 0
        self._pb[n:n + m, :Co] = other.pos
        self._pb[n:n + m, Co:] = -1
        self._set(self._kb, self._vb, self._pb, n + m)

    def move(self, dst: list[int], src: list[int], n: int) -> None:
        """Rows `src` copied into rows `dst`, then only the first n rows kept (in place; `drop_order`).
        When fewer than a quarter of the buffers' rows stay, the buffers shrink to fit them; when
        none stay, they are kept whole for the rows that join next (the engine's `parked` store)."""
        if dst:
            d, s = (torch.tensor(x, device=self._pb.device) for x in (dst, src))
            for buf in (*self._kb, *self._vb, self._pb):
                buf[d] = buf[s]
        self._set(self._kb, self._vb, self._pb, n)
        if 0 < n and 4 * n < int(self._pb.shape[0]):  # (n = 0: the buffers are kept for the next rows)
            self._resize(n, self.capacity)

    def rows(self, sel: torch.Tensor) -> "SlotStore":
        """The rows `sel` (copies). An unbounded store keeps only the slots up to its rows'
        newest key, so memory held for a long request that left is freed."""
        pos = self.pos[sel]
        C = self.capacity
        if self.ring is None and self.limit is None:
            C = max(1, int(pos.max()) + 1)
        return SlotStore([t[sel, :, :C] for t in self.k], [t[sel, :, :C] for t in self.v], pos[:, :C],
                      self.ring, self.limit)

    @staticmethod
    def cat(parts: list["SlotStore"]) -> "SlotStore":
        out = SlotStore([t[:0] for t in parts[0].k], [t[:0] for t in parts[0].v], parts[0].pos[:0], parts[0].ring,
                     parts[0].limit)
        out._resize(sum(p.n for p in parts), max(p.capacity for p in parts))
        for p in parts:
            out.append(p)
        return out


def drop_order(B: int, rows: list[int]) -> tuple[int, list[int], list[int], list[int]]:
    """Dropping `rows` of B by filling each hole below the new size with a live row from above it:
    (the new size, the holes, the rows moved into them, the new order as old indices)."""
    gone = set(rows)
    n = B - len(gone)
    holes = [i for i in range(n) if i in gone]
    movers = [i for i in range(n, B) if i not in gone]
    order = list(range(n))
    for h, m in zip(holes, movers):
        order[h] = m
    return n, holes, movers, order


__all__ = ["SlotStore", "drop_order", "rebuffer"]
