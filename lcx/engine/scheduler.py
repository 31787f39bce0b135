"""The engine's scheduler: which tokens of which requests run this step (as vLLM's v1 scheduler,
`vllm/v1/core/sched/scheduler.py`). It owns the queues (waiting, partly prefilled, running) and
decides admission (batch slots, fair across groups), chunked prefill under the token budget, and
prefix-cache lookups; it knows nothing of tensors (a lookup's held KV is handed on opaque, a
`lcx.engine.prefix.RowKV`; it imports no torch). The model runner (`lcx.engine.runner`) turns its decisions into
forwards; `lcx.engine.core.Engine` loops the two and owns each request's state
(`lcx.engine.request.Request`).
The policy ("Fair service", "Prefill continuing from held KV") is stated in `lcx.engine`'s
docstring; the block grid and what can be reused in `lcx.engine.prefix`'s.
"""

from __future__ import annotations

from typing import Any, Sequence

from .outputs import EngineStats
from .params import EngineConfig
from .request import Request


class Scheduler:
    """The queues and the per-step decision (module docstring).

    prefix_cache: an `lcx.engine.prefix.PrefixCache` or None; window: the (n_first, n_recent) a
    row's held KV keeps (`Applied.kv_window`, what a lookup hands back); chunkable: whether a
    prompt may be prefilled in several calls (`lcx.engine.prefix`).
    """

    def __init__(self, config: EngineConfig, prefix_cache: Any, window: tuple[int, int] | None, chunkable: bool,
                 stats: EngineStats):
        self.config, self.prefix_cache, self.window, self.chunkable = config, prefix_cache, window, chunkable
        self.stats = stats
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []  # admitted, prompt partly prefilled (chunked prefill)
        self.running: list[Request] = []  # decoding: the rows of the runner's KV store, in order

    # ------------------------------------------------------------------ queues
    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def remove(self, rid: str) -> tuple[str, int, Request] | None:
        """Take request `rid` out of its queue: (queue name, index, request), or None if unknown.
        A running request's row stays in the runner's store: the caller drops it (index)."""
        for name in ("waiting", "prefilling", "running"):
            queue = getattr(self, name)
            for i, r in enumerate(queue):
                if r.rid == rid:
                    if name != "running":
                        del queue[i]
                    return name, i, r
        return None

    def clear(self) -> list[Request]:
        out = self.waiting + self.prefilling + self.running
        self.waiting, self.prefilling, self.running = [], [], []
        return out

    def reorder_running(self, order: list[int]) -> None:
        """The running requests after the runner dropped rows: `order[i]` is the old index of
        the request now in row i (`lcx.engine.runner.ModelRunner.drop_rows`)."""
        self.running = [self.running[i] for i in order]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ------------------------------------------------------------------ this step's prefill
    def schedule_prefill(self) -> list[tuple[Request, int]]:
        """This step's prefill work: (request, prompt tokens to prefill now); see "Fair service"
        in `lcx.engine`'s docstring. Without a token budget: every waiting request that has a batch
        slot, its whole prompt. With `max_num_batched_tokens`: the budget left after this step's
        decode rows goes first to the oldest partly prefilled prompt (a block: it always
        progresses), then shortest remaining prompt first, the rest back to that oldest prompt."""
        budget = self.config.max_num_batched_tokens
        left = float("inf") if budget is None else budget - len(self.running)
        admit = self._admissible()
        if budget is None:
            for r in admit:
                self._start(r)
            return [(r, len(r.prompt_ids) - r.done) for r in self.prefilling]
        grant: dict[int, int] = {}  # id(request) -> tokens this step
        oldest = self.prefilling[0] if self.prefilling else None
        if oldest is not None:
            grant[id(oldest)] = c = self._chunk(oldest, min(left, self.config.prefix_block_size), first=True)
            left -= c
        for r in sorted(self.prefilling[1:] + admit, key=lambda x: len(x.prompt_ids) - x.done):
            c = self._chunk(r, left, first=not grant)
            if not c:
                continue
            if r not in self.prefilling:
                self._start(r)
            grant[id(r)] = c
            left -= c
        if oldest is not None and left > 0:  # the rest of the budget back to the oldest prompt
            grant[id(oldest)] += self._chunk_extra(oldest, grant[id(oldest)], left)
        return [(r, grant[id(r)]) for r in self.prefilling if grant.get(id(r))]

    def _admissible(self) -> list[Request]:
        """Waiting requests that may take a batch slot now (looked up in the prefix cache), fairly
        across groups: the group holding the fewest slots first (FIFO among equals), and no group
        holds more than max_batch - max(1, max_batch // 8) slots (max_batch >= 2), so a new
        client's request finds a slot at once beside a heavy one (n = 256 samples)."""
        free = self.config.max_batch - len(self.running) - len(self.prefilling)
        if free <= 0 or not self.waiting:
            return []
        held: dict[str, int] = {}
        for x in self.running + self.prefilling:
            held[x.group] = held.get(x.group, 0) + 1
        cap = self.config.max_batch
        if cap >= 2:
            cap -= max(1, cap // 8)
        out: list[Request] = []
        order = sorted(range(len(self.waiting)), key=lambda i: (held.get(self.waiting[i].group, 0), i))
        for i in order:
            if len(out) == free:
                break
            r = self.waiting[i]
            if held.get(r.group, 0) >= cap and (out or self.running or self.prefilling):
                continue
            if not r.looked_up and self._shares_uncached(r, out):
                continue  # next step it reuses what an earlier request computes now
            held[r.group] = held.get(r.group, 0) + 1
            if not r.looked_up:
                r.looked_up = True
                self._lookup(r)
            out.append(r)
        return out

    def _shares_uncached(self, r: Request, admitted: list[Request]) -> bool:
        """Whether `r` shares a whole block of prompt, beyond what that request reuses from the
        cache, with a request admitted this step: its prefill stores the block, so `r` waits one
        step and reuses it (a burst of requests with one system prompt computes it once; results
        unchanged: the cache is exact)."""
        if self.prefix_cache is None or r.params.prompt_logprobs is not None:
            return False
        bs = self.config.prefix_block_size
        a = r.prompt_ids
        for o in admitted:
            b = o.prompt_ids
            limit = min(len(a), len(b)) - 1  # blocks below each prompt's last token
            n = o.done
            if n + bs > limit or a[:n + bs] != b[:n + bs]:
                continue
            return True
        return False

    def _start(self, r: Request) -> None:
        self.waiting.remove(r)
        self.prefilling.append(r)

    def _chunk_extra(self, r: Request, have: int, left: float) -> int:
        rest = len(r.prompt_ids) - r.done - have
        if rest <= left:
            return rest
        if not self.chunkable:
            return 0
        bs = self.config.prefix_block_size
        return int(left) // bs * bs

    def _chunk(self, r: Request, left: float, *, first: bool) -> int:
        """Prompt tokens of `r` to prefill with `left` tokens of budget (0: none this step). A
        step always makes progress: the first work item gets at least a block. A chunk that does
        not end the prompt is whole blocks, so every prompt's progress stays on the prefix
        cache's block grid: a chunk ending inside a block would leave that block unstored (each
        call stores the blocks it computes whole) and every later block of the prompt unreachable."""
        rest = len(r.prompt_ids) - r.done
        if rest <= left:
            return rest
        if not self.chunkable:  # one call for the whole remainder (`lcx.engine.prefix`)
            return rest if first else 0
        bs = self.config.prefix_block_size
        c = int(max(left, 0)) // bs * bs
        if c <= 0:
            return min(rest, bs) if first else 0
        return c

    def _lookup(self, r: Request) -> None:
        """Reuse the longest cached prefix of a new request's prompt (`lcx.engine.prefix`)."""
        if self.prefix_cache is None or r.params.prompt_logprobs is not None:
            return
        n, row = self.prefix_cache.lookup(r.prompt_ids, self.window)
        st = self.stats
        st.prefix_cache_queries += 1
        st.prefix_cache_query_tokens += len(r.prompt_ids) - 1
        if n:
            r.kv, r.done, r.cached = row, n, n
            st.prefix_cache_hits += 1
            st.prefix_cache_hit_tokens += n

    # ------------------------------------------------------------------ orders for a batch of prompts
    def reuse_order(self, prompts: list[Sequence[int]]) -> list[int]:
        """The order `Engine.generate` submits `prompts` in: with the prefix cache, the prompt
        sharing the most with the others first (a passkey sweep's deepest needle: every other
        prompt shares the instruction and the haystack up to its own needle with it), so the
        others, admitted a step later (`_shares_uncached`), reuse it; else as given. Outputs keep
        the caller's order; tokens are the same either way (the cache is exact)."""
        n = len(prompts)
        if self.prefix_cache is None or n < 2:
            return list(range(n))
        chains = block_chains(prompts, self.config.prefix_block_size)
        score = [sum(shared_blocks(chains[i], chains[j]) for j in range(n) if j != i) for i in range(n)]
        lead = max(range(n), key=lambda i: (score[i], -i))
        return [lead] + [i for i in range(n) if i != lead]

    def reuse_chain(self, prompts: list[Sequence[int]]) -> list[int]:
        """An order for running `prompts` one at a time so that each reuses the most of the one
        before it from the prefix cache (`Engine.reuse_chain`)."""
        order = self.reuse_order(prompts)
        if self.prefix_cache is None or len(prompts) < 3:
            return order
        chains = block_chains(prompts, self.config.prefix_block_size)
        chain, left = [order[0]], sorted(order[1:])
        while left:
            prev = chains[chain[-1]]
            nxt = max(left, key=lambda j: (shared_blocks(prev, chains[j]), -j))
            chain.append(nxt)
            left.remove(nxt)
        return chain


def block_chains(prompts: list[Sequence[int]], bs: int) -> list[list[int]]:
    """Per prompt, a chained hash of each whole `bs`-token block below its last token (the blocks a
    prefix cache can hand on): equal k-th entries mean equal first k blocks. Computed once per
    prompt, so comparing two prompts copies nothing."""
    out = []
    for p in prompts:
        h, chain = 0, []
        for k in range((len(p) - 1) // bs):
            h = hash((h, tuple(p[k * bs:(k + 1) * bs])))
            chain.append(h)
        out.append(chain)
    return out


def shared_blocks(a: list[int], b: list[int]) -> int:
    """How many leading blocks two `block_chains` entries share (binary search: the chain makes
    equality a prefix property)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["Request", "Scheduler", "block_chains", "shared_blocks"]
