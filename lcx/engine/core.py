"""The engine: a thin loop over the scheduler and the model runner, and each request's state
(as vLLM's v1 `EngineCore`). Each step: the running requests decode one token (`ModelRunner.decode`),
then the scheduler's prefill work runs (`Scheduler.schedule_prefill`, `ModelRunner.prefill`);
the engine samples, detokenizes, checks stop conditions and hands out `StepEvent`s.

    lcx.engine.scheduler   queues, admission, fairness, chunked prefill, prefix-cache lookups (no tensors)
    lcx.engine.runner      the forwards with the method's hooks, the bounded KV store (no request history)
    lcx.engine.core        this: wiring, request state, sampling and events

The batch layout, sampling order and limits are stated once in `lcx.engine`'s docstring."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..hf.head import check_head
from ..hf.rope_patch import static_rope_bases
from ..method_config import MethodConfig
from .detok import Detokenizer, find_stop, stable_end
from .applying import running_methods, to_apply
from .kv import KVLayout, ModelKV
from .outputs import EngineStats, RequestOutput, StepEvent, collect_output
from .params import DEFAULT_PREFIX_CACHE_BYTES, ContextLengthError, EngineConfig, SamplingParams, is_int
from .prefix import PrefixCache, reuse_refusal
from .runner import (ModelRunner, loaded_rows_windows, position_masks, windowed_rows,
                     windowed_rows_scope)
from .sampling import greedy_and_logprobs, logprob_rows, sample
from .request import Request
from .scheduler import Scheduler

log = logging.getLogger(__name__)

_Seq = Request  # (earlier name)
# (names earlier code imports from here: tests, benchmarks/prefill.py)
_loaded_rows_windows, _position_masks, _static_bases = loaded_rows_windows, position_masks, static_rope_bases


class Engine:
    """Batched prefill/decode over an HF `*ForCausalLM` of a supported family (module docstring).

    Not thread-safe: one thread owns an engine (the server's worker). `validate` touches no
    model state and may be called from anywhere.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, config: EngineConfig | None = None):
        from ..hf import check_model_type

        config = config or EngineConfig()
        check_model_type(model, "lcx.engine")
        check_head(model)  # its logits are what the engine forms from hidden states (head_logits)
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, config
        # what the engine applies (`lcx.engine.applying.to_apply`: the config, or the method the model arrives patched
        # with, on the fastest exact backend), what `apply` did (`lcx.hf.applied.Applied`: the RoPE
        # spec resolved once, the lengths, each layer's method, window and RoPE basis, the backends
        # the patch runs) and what the engine runs (`running_methods`: with the method the model records)
        self.applied = applied = to_apply(model, config.methods).apply(model)
        self.methods: MethodConfig = (methods := running_methods(applied))
        self.max_model_len = int(config.max_model_len or applied.context_len)
        self.vocab_size = int(model.config.vocab_size)
        eos = getattr(model.config, "eos_token_id", None)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or eos
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self.eos_ids = eos_ids
        self.pad_id = int(next(iter(sorted(eos_ids)), 0) if tokenizer.pad_token_id is None
                          else tokenizer.pad_token_id)
        # the model runner: the forwards with the method's hooks, the bounded KV store
        self.runner = ModelRunner(model, applied, methods, pad_id=self.pad_id, packed_linear=config.packed_linear,
                                  lean_decode=config.lean_decode)
        self.cache_layout: KVLayout = self.runner.cache_layout
        self.device, self.dtype = self.runner.device, self.runner.dtype
        if self.device.type == "cpu":  # (torch's default threads on a busy machine: say so, once)
            from ..threads import warn_contention

            warn_contention()
        self.stats = EngineStats()
        # prefix reuse and chunked prefill (`lcx.engine.prefix`): why not, or None
        self.prefix_cache_refusal: str | None = reuse_refusal(methods, applied.bases is not None)
        self._window = applied.kv_window  # what a row's held KV keeps between prefill calls
        chunkable = self.prefix_cache_refusal is None and not (
            methods.attention is not None and methods.attention.last_query_extra)
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_caching and self.prefix_cache_refusal is None:
            name = getattr(model.config, "_name_or_path", None) or type(model).__name__
            self.prefix_cache = PrefixCache({"methods": self.methods_info(), "model": name, "dtype": str(self.dtype),
                                             "model_rope": getattr(model.config, "rope_parameters", None)},
                                            block_size=config.prefix_block_size,
                                            max_bytes=DEFAULT_PREFIX_CACHE_BYTES if config.prefix_cache_bytes is None
                                            else config.prefix_cache_bytes)
            if config.prefix_cache_bytes is None:  # auto: the longest prompt accepted is kept whole
                from .memory import MEMORY_FRACTION, available_memory

                self.fit_prefix_cache(self.max_model_len, limit=int(MEMORY_FRACTION * available_memory(self.device)))
        # the scheduler: queues, admission, chunked prefill, prefix-cache lookups
        self.scheduler = Scheduler(config, self.prefix_cache, self._window, chunkable, self.stats)
        self._next_id = 0
        self._ids: set[str] = set()
        self._detok = Detokenizer(tokenizer)

    # (views of the runner's and the scheduler's state, for tests and tools)
    _decoder = property(lambda self: self.runner.decoder)
    _loaded_rows = property(lambda self: self.runner.loaded_rows)
    _whole_prompt_rows = property(lambda self: self.runner.whole_prompt_rows)
    _row_attention = property(lambda self: self.runner.row_attention)
    _store = property(lambda self: self.runner.store)
    _waiting = property(lambda self: self.scheduler.waiting)
    _prefilling = property(lambda self: self.scheduler.prefilling)
    _seqs = property(lambda self: self.scheduler.running)

    def methods_info(self) -> dict[str, Any]:
        """What the engine runs, for people and records (the server's model card): `methods` in
        the nested form, the RoPE spec resolved against the model, and the per-row KV window
        (`[n_first, n_recent]` covering every layer's: on Gemma 3 the sliding layers' 512 too;
        None: some layer keeps every key)."""
        d = self.methods.to_dict()
        spec = self.applied.rope
        if spec is not None:
            d["rope"] = spec.to_dict()
        window = self._window
        d["kv_window"] = list(window) if window is not None else None
        return d

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: EngineConfig | None = None, *,
                        dtype: torch.dtype | str = torch.float32, device: str = "cpu") -> "Engine":
        """Load with `lcx.load_model` (HF dir, .gguf, preset, Hub id) and build an engine."""
        from ..models import load_model

        model, tok = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tok, config)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self._detok.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level BPE token may be part of a UTF-8 character)."""
        return self._detok.token_bytes(token_id)

    def token_str(self, token_id: int) -> str:
        """One token as text for logprob listings (`lcx.engine.detok.Detokenizer.token_str`)."""
        return self._detok.token_str(token_id)


    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise `ValueError` (naming the problem) if the request cannot run as asked."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_ids if not is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {self.vocab_size}); got {bad[:5]}")
        if n > self.max_model_len:
            raise ContextLengthError(f"the prompt has {n} tokens but max_model_len is {self.max_model_len}; "
                             "shorten the prompt (lcx never truncates it)", "prompt")
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{n + params.max_tokens} exceeds max_model_len {self.max_model_len}; "
                             f"lower max_tokens to at most {self.max_model_len - n}", "max_tokens")

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, group: str | None = None) -> str:
        """Queue a request (validated first; `ValueError` if it cannot run). Returns its id.
        `group`: requests that share it (the n samples of one API call) count as one client in
        the fair scheduler (module docstring); default: the request alone."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids] if all(is_int(t) for t in prompt_ids) else list(prompt_ids)
        self.validate(prompt_ids, params)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._ids.add(request_id)
        seq = Request(request_id, prompt_ids, params, self.eos_ids)
        seq.group = group if group is not None else request_id
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> StepEvent | None:
        """Drop a waiting or running request; returns its final event (None if unknown)."""
        found = self.scheduler.remove(request_id)
        if found is None:
            return None
        where, i, s = found
        s.kv = None
        ev = self._finish_event(s, "abort")
        if where == "running":
            self._drop_rows([i])
        return ev

    def reset(self) -> list[str]:
        """Drop every waiting and running request (after an unexpected failure); returns their ids."""
        ids = [s.rid for s in self.scheduler.clear()]
        self.runner.store = self.runner.parked = None
        self._ids.clear()
        return ids

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run `prompts` (token id lists) to completion, batched, and return them in order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids: list[str] = [""] * len(prompts)
        for i in self._reuse_order(prompts):
            ids[i] = self.add_request(prompts[i], params[i])
        outs: dict[str, RequestOutput] = {}
        acc: dict[str, list[StepEvent]] = {i: [] for i in ids}
        while len(outs) < len(ids):
            for ev in self.step():
                if ev.request_id not in acc:
                    continue
                acc[ev.request_id].append(ev)
                if ev.finished:
                    outs[ev.request_id] = collect_output(ev.request_id, prompts[ids.index(ev.request_id)],
                                                   acc.pop(ev.request_id),
                                                   params[ids.index(ev.request_id)])
        return [outs[i] for i in ids]

    def _reuse_order(self, prompts: list[Sequence[int]]) -> list[int]:
        return self.scheduler.reuse_order(prompts)

    def forward_scope(self, input_ids: torch.Tensor) -> contextlib.AbstractContextManager:
        """The context for a plain forward of this engine's model over whole rows `input_ids`
        `[B, T]` (no cache, each row at positions 0..T-1, right padding read as tokens: how the
        `lcx` lm-eval model scores loglikelihoods): `windowed_rows_scope` for a windowed model as
        loaded, as the engine's own prefill runs it; nothing otherwise."""
        return self.runner.forward_scope(input_ids)

    def fit_prefix_cache(self, n_tokens: int, *, limit: int | None = None) -> int:
        """Raise the prefix cache's byte bound, if needed, to hold one prompt of `n_tokens` whole
        (every layer's keys and values; `reuse_chain`'s runs reuse each prompt's predecessor, and
        a prompt longer than the bound keeps only its head), to at most `limit` bytes. Returns the
        bound (0 without a cache). The `lcx` lm-eval model calls it with a cell's longest prompt
        unless given a bound; `prefix_cache_bytes=None` with max_model_len, limited to
        `MEMORY_FRACTION` of the memory available at start-up."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        from ..hf.models import model_shape

        bs = cache.block_size
        per_token = model_shape(self.model).kv_bytes_per_token(self.dtype.itemsize)
        need = -(-max(int(n_tokens), 0) // bs) * bs * per_token
        if limit is not None and need > limit:
            log.info("prefix cache: a %d-token prompt needs %d bytes; the bound is limited to %d", n_tokens, need, limit)
            need = limit
        if need > cache.max_bytes:
            log.info("prefix cache: bound raised from %d to %d bytes to hold a %d-token prompt",
                     cache.max_bytes, need, n_tokens)
            cache.max_bytes = need
        return cache.max_bytes

    def reuse_chain(self, prompts: list[Sequence[int]]) -> list[int]:
        """An order for running `prompts` one at a time so that each reuses the most of the one
        before it from the prefix cache (which may hold little more than one long prompt): the
        lead of `_reuse_order`, then repeatedly the remaining prompt sharing the most whole blocks
        with the previous one (ties: the given order). A passkey sweep runs deepest needle first,
        each prompt reusing the haystack up to its own needle. As given without the cache."""
        return self.scheduler.reuse_chain(prompts)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[StepEvent]:
        """Decode one token for the running requests and run this step's prefill work (the
        scheduler's: admitted requests, chunks of partly prefilled prompts) in one batched call:
        both in one forward where the model allows (`EngineConfig.mixed_step`), else the decode
        forward first, then the prefill's.

        Returns one event per request that produced something or finished. A failure confined
        to one request (its prefill, sampling or detokenisation) fails that request only.
        """
        self.runner.check_hook()
        work = mixed = None
        if self.scheduler.running and self.config.mixed_step and self.runner.can_mix(self.runner.store):
            work = self.scheduler.schedule_prefill()  # (before the decode: vLLM's order)
            if work:
                t0 = time.perf_counter()
                mixed = events = self._mixed_step(work)
                if mixed is not None:
                    self.stats.mixed_s += time.perf_counter() - t0
        if mixed is None:
            events = []
            if self.scheduler.running:
                t0 = time.perf_counter()
                events += self._decode_step()
                self.stats.decode_s += time.perf_counter() - t0
            if not work:  # (none found before the decode: the slots it freed may take some now)
                work = self.scheduler.schedule_prefill()
            if work:
                t0 = time.perf_counter()
                events += self._prefill(work)
                self.stats.prefill_s += time.perf_counter() - t0
        for ev in events:
            if ev.finished:
                self._ids.discard(ev.request_id)
        return events

    def _mixed_step(self, work: list[tuple[Request, int]]) -> list[StepEvent] | None:
        """The running rows' decode and `work`'s prefill in one forward (`ModelRunner.mixed`);
        None if that forward failed (the step then runs them apart, which isolates the culprit)."""
        running = self.scheduler.running
        try:
            logits, out = self.runner.mixed(self.runner.store, [s.out_ids[-1] for s in running],
                                            [s.next_position for s in running],
                                            [(s.prompt_ids[s.done:s.done + c], s.done, s.kv) for s, c in work])
        except Exception as e:  # noqa: BLE001
            log.warning("a step's decode and prefill in one forward failed (%s); running them apart", e)
            return None
        self.stats.mixed_steps += 1
        return self._decode_events(logits, {}) + self._prefill_events(work, out)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, work: list[tuple[Request, int]]) -> list[StepEvent]:
        seqs = [s for s, _ in work]
        try:
            out = self.runner.prefill([(s.prompt_ids[s.done:s.done + c], s.done, s.kv) for s, c in work])
        except Exception as e:  # noqa: BLE001 - isolate: retry one by one, fail only the culprits
            if len(work) == 1:
                log.exception("prefill failed for request %s", seqs[0].rid)
                self.scheduler.prefilling.remove(seqs[0])
                self._finish(seqs[0], "error", error=e)
                return [self._event(seqs[0])]
            log.warning("batched prefill of %d requests failed (%s); retrying one by one", len(seqs), e)
            return [ev for w in work for ev in self._prefill([w])]
        return self._prefill_events(work, out)

    def _prefill_events(self, work: list[tuple[Request, int]], out: Any) -> list[StepEvent]:
        """After a prefill call (`PrefillOutput`): prefix-cache inserts, prompt logprobs, each
        finished prompt's first token; finished prompts join the running batch."""
        seqs = [s for s, _ in work]
        self.stats.prefill_batches += 1
        self.stats.prefill_chunks += sum(1 for s, _ in work if s.done > s.cached)
        self.stats.prompt_tokens_computed += sum(c for _, c in work)
        h, C = out.hidden, out.n_new
        events: list[StepEvent] = []
        keep: list[int] = []
        ends = [i for i, (s, c) in enumerate(work) if s.done + c == len(s.prompt_ids) and s.params.max_tokens > 0]
        logits = self.runner.logits(h[ends, -1]) if ends else None  # [e, V]
        for i, (s, c) in enumerate(work):
            start, T = s.done, len(s.prompt_ids)
            try:
                if self.prefix_cache is not None:
                    self.prefix_cache.insert(s.prompt_ids, start, *out.new_kv(i, c))
                if s.params.prompt_logprobs is not None:
                    rows = h[i, C - c:] if start + c < T else h[i, C - c:-1]  # predict tokens start+1 ...
                    if rows.shape[0]:
                        s.plog += logprob_rows(self.runner.logits(rows),
                                               s.prompt_ids[start + 1:start + 1 + rows.shape[0]],
                                               s.params.prompt_logprobs)
                s.done = start + c
                if s.done < T:  # continue next step from the kept slots
                    s.kv = out.held(i, s.done, self._window)
                    continue
                self.scheduler.prefilling.remove(s)
                s.kv = None
                self.stats.prompt_tokens += T
                ev = StepEvent(s.rid)
                if s.params.prompt_logprobs is not None:
                    ev.prompt_logprobs = s.prompt_logprobs = [None] + s.plog
                if s.params.max_tokens == 0:
                    self._finish(s, "length")
                else:
                    self._accept(s, logits[ends.index(i)], ev)
                self._fill_event(s, ev)
                events.append(ev)
                if not s.finished:
                    keep.append(i)
            except Exception as e:  # noqa: BLE001
                log.exception("post-processing failed for request %s", s.rid)
                if s in self.scheduler.prefilling:
                    self.scheduler.prefilling.remove(s)
                self._finish(s, "error", error=e)
                events.append(self._event(s))
        if keep:  # the finished prompts join the running batch
            self.runner.add_rows(out, keep, [len(seqs[i].prompt_ids) + seqs[i].params.max_tokens for i in keep])
            self.scheduler.running += [seqs[i] for i in keep]
        return events

    # ------------------------------------------------------------------ decode
    def _decode_step(self) -> list[StepEvent]:
        B = len(self.scheduler.running)
        try:
            logits = self._decode_forward(self.runner.store, self.scheduler.running)
            failed: dict[int, BaseException] = {}
        except Exception as e:  # noqa: BLE001 - isolate: run rows one by one, fail only the culprits
            if B == 1:
                logits, failed = None, {0: e}
            else:
                log.warning("batched decode of %d rows failed (%s); retrying row by row", B, e)
                logits, failed = self._decode_rows_separately()
        return self._decode_events(logits, failed)

    def _decode_events(self, logits: torch.Tensor | None, failed: dict[int, BaseException]) -> list[StepEvent]:
        """After a decode forward (`logits` `[B, V]` of the running rows; `failed`: rows whose
        forward failed): sample, check stops; finished rows leave the batch."""
        B = len(self.scheduler.running)
        self.stats.decode_steps += 1
        self.stats.batch_size_hist[B] = self.stats.batch_size_hist.get(B, 0) + 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, B)
        events: list[StepEvent] = []
        done: list[int] = []
        greedy, lps = greedy_and_logprobs(logits, self.scheduler.running) if logits is not None else (None, None)
        for i, s in enumerate(self.scheduler.running):
            if i in failed:
                log.error("decode failed for request %s: %r", s.rid, failed[i])
                self._finish(s, "error", error=failed[i])
                events.append(self._event(s))
                done.append(i)
                continue
            try:
                ev = StepEvent(s.rid)
                self._accept(s, logits[i], ev, greedy=greedy[i], logprobs=None if lps is None else lps[i])
                self._fill_event(s, ev)
            except Exception as e:  # noqa: BLE001
                log.exception("post-processing failed for request %s", s.rid)
                self._finish(s, "error", error=e)
                ev = self._event(s)
            events.append(ev)
            if s.finished:
                done.append(i)
        if done:
            self._drop_rows(done)
        return events

    def _decode_forward(self, store: ModelKV, seqs: list[Request]) -> torch.Tensor:
        """One decode forward of `seqs` (the rows of `store`, in order): each row's last sampled
        token at its position (`ModelRunner.decode`); logits `[b, V]`."""
        return self.runner.decode(store, [s.out_ids[-1] for s in seqs], [s.next_position for s in seqs])

    def _decode_rows_separately(self):
        """Fallback after a failed batched decode: one forward per row on its own copy of the
        cache, the copies then stacked back. Failed rows get zero logits (never read: they are
        dropped right after)."""
        seqs = self.scheduler.running
        failed: dict[int, BaseException] = {}
        parts: list[ModelKV] = []
        logits: list[torch.Tensor | None] = []
        for i in range(len(seqs)):
            sub = self.runner.store.rows([i])
            try:
                logits.append(self._decode_forward(sub, [seqs[i]]))
            except Exception as e:  # noqa: BLE001
                failed[i] = e
                logits.append(None)
            parts.append(sub)
        self.runner.store = ModelKV.cat(parts)
        ok = [x for x in logits if x is not None]
        if not ok:
            return None, failed
        return torch.cat([x if x is not None else torch.zeros_like(ok[0]) for x in logits]), failed

    def _drop_rows(self, rows: list[int]) -> None:
        order = self.runner.drop_rows(rows)  # (the store's rows move: the running list follows)
        self.scheduler.reorder_running(order)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the running batch's cached keys and values (0 when idle): the allocated
        slots of every row (`lcx.engine.kv`)."""
        store = self.runner.store
        return 0 if store is None else store.nbytes()

    @property
    def cache_len(self) -> int:
        """Slots per row of the running batch's KV cache in its widest layer (0 when idle)."""
        store = self.runner.store
        return 0 if store is None else store.slots

    @property
    def layer_cache_lens(self) -> list[int]:
        """Slots per row of each layer's KV cache (zeros when idle): a hybrid model's sliding
        layers hold their window, whatever the length (`lcx.engine.kv`)."""
        store = self.runner.store
        return [0] * self.cache_layout.n_layers if store is None else store.layer_slots()

    @property
    def layer_windows(self) -> list[tuple[int, int] | None]:
        """Per layer, (n_first, n_recent): the keys its query sees are among the first n_first and
        the last n_recent (its method's `cache_window`; a layer running its own sliding window w:
        (0, w)), or None: every key (`Applied.layer_windows`)."""
        return list(self.applied.layer_windows)

    @property
    def layer_kv_cache_bytes(self) -> list[int]:
        """Bytes of each layer's cached keys and values (zeros when idle)."""
        store = self.runner.store
        return [0] * self.cache_layout.n_layers if store is None else store.layer_nbytes()

    # ------------------------------------------------------------------ tokens, events
    def _sample(self, s: Request, logits: torch.Tensor, greedy: int | None = None) -> int:
        return sample(s, logits, greedy)

    def _accept(self, s: Request, logits: torch.Tensor, ev: StepEvent, *, greedy: int | None = None,
                logprobs: torch.Tensor | None = None) -> None:
        """Sample the next token of `s` from `logits [V]`, record it, check stop conditions.
        `greedy` (argmax) and `logprobs` (log_softmax of logits) may come precomputed for the batch."""
        tok = self._sample(s, logits, greedy)
        s.out_ids.append(tok)
        if s.seen is not None:
            s.seen[tok] = True
        if s.counts is not None:
            s.counts[tok] += 1
        ev.token_ids.append(tok)
        self.stats.generated_tokens += 1
        if s.params.logprobs is not None:
            lp = logprob_rows(logits[None], [tok], s.params.logprobs, log_probs=logprobs)[0]
            s.logprobs.append(lp)
            ev.logprobs.append(lp)
        if tok in s.stop_ids:
            s.text = self.decode(s.out_ids)
            self._finish(s, "stop", stop_reason=tok if tok not in self.eos_ids else None)
            return
        prev = len(s.text)
        s.text = self.decode(s.out_ids)
        if s.params.stop and len(s.out_ids) >= s.params.min_tokens:
            hit = find_stop(s.text, prev, s.params.stop)
            if hit is not None:
                i, x = hit
                s.text = s.text[:i]
                self._finish(s, "stop", stop_reason=x)
                return
        if len(s.out_ids) >= s.params.max_tokens:
            self._finish(s, "length")

    def _finish(self, s: Request, reason: str, *, stop_reason: str | int | None = None,
                error: BaseException | None = None) -> None:
        s.finished, s.finish_reason, s.stop_reason, s.error = True, reason, stop_reason, error
        self.stats.finished[reason] += 1

    def _fill_event(self, s: Request, ev: StepEvent) -> None:
        """Move newly stable text into `ev` and copy the finish state."""
        end = len(s.text) if s.finished else stable_end(s.text, s.sent, s.params.stop)
        if end > s.sent:
            ev.text = s.text[s.sent:end]
            s.sent = end
        ev.finished, ev.finish_reason, ev.stop_reason, ev.error = s.finished, s.finish_reason, s.stop_reason, s.error

    def _event(self, s: Request) -> StepEvent:
        ev = StepEvent(s.rid)
        if s.finish_reason != "error":
            self._fill_event(s, ev)
        else:
            ev.finished, ev.finish_reason, ev.error = True, "error", s.error
        return ev

    def _finish_event(self, s: Request, reason: str) -> StepEvent:
        self._finish(s, reason)
        self._ids.discard(s.rid)
        return self._event(s)



__all__ = ["Engine", "windowed_rows", "windowed_rows_scope"]
