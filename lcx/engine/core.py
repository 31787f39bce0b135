"""The engine: per-request state and the scheduler loop (prefill, decode, sampling, detokenization).
The batch layout, sampling order and limits are stated once in `lcx.engine`'s docstring."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from .batch import hf_cache
from .detok import Detokenizer, find_stop, stable_end
from .kv import CacheLayout, KVLayout, ModelKV
from .prefix import PrefixCache, RowKV, reuse_refusal, stack_rows
from ..hf.head import check_head, head_logits
from ..hf.attention_patch import loaded_windows
from ..hf.recorded import recorded_method
from ..hf.rope_patch import static_rope_bases
from ..method_config import INFERENCE_BACKEND, MethodConfig
from ..rope import ROPE_TYPES
from .outputs import EngineStats, RequestOutput, StepEvent, TokenLogprob, collect_output
from .params import DEFAULT_PREFIX_CACHE_BYTES, ContextLengthError, EngineConfig, SamplingParams, is_int
from .sampling import greedy_and_logprobs, logprob_rows, sample

log = logging.getLogger(__name__)

# ============================================================================================
# Per-request state
# ============================================================================================

class _Seq:
    """One request inside the engine."""

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int]):
        self.rid, self.prompt_ids, self.params = rid, prompt_ids, params
        self.out_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        # penalty state, made on first use on the logits' device: which tokens the prompt or
        # output hold (repetition_penalty) [V] bool, and the output's token counts [V] float64
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.gen: torch.Generator | None = None
        if params.temperature > 0:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        self.text = ""  # full decoded text of out_ids (cut at a stop string once finished)
        self.sent = 0  # characters of `text` already handed out in events
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: BaseException | None = None
        # prefill progress (`lcx.engine.prefix`): prompt tokens whose KV is held (`kv`, prefill
        # form), of which `cached` came from the prefix cache; prompt logprobs so far
        self.done = 0
        self.cached = 0
        self.looked_up = False
        self.group = rid  # the fair scheduler's client (`Engine.add_request`)
        self.kv: RowKV | None = None
        self.plog: list[TokenLogprob] = []

    @property
    def next_position(self) -> int:
        """Position of the last sampled token, the one the next decode step feeds."""
        return len(self.prompt_ids) + len(self.out_ids) - 1


# ============================================================================================
# Engine
# ============================================================================================

class Engine:
    """Batched prefill/decode over an HF `*ForCausalLM` of a supported family (module docstring).

    Not thread-safe: one thread owns an engine (the server's worker). `validate` touches no
    model state and may be called from anywhere.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, config: EngineConfig | None = None):
        from ..hf import check_model_type, decoder
        from ..hf.attention_patch import DEFAULT_BACKEND, current_patch

        config = config or EngineConfig()
        check_model_type(model, "lcx.engine")
        check_head(model)  # its logits are what the engine forms from hidden states (head_logits)
        self.model, self.tokenizer, self.config = model.eval(), tokenizer, config
        self._decoder = decoder(model)  # the stack the batched forwards call (no lm_head)
        # fast by default: an attention method without a backend named runs on the fastest exact
        # one that supports its calls (`INFERENCE_BACKEND`, flash, else lcx.methods' blockwise)
        methods = config.methods
        if methods.attention is None:
            # none asked for, and the model arrives patched (`lcx.load_model` applies what its
            # config asks for, e.g. DCA: `lcx.hf.config_attention`): the engine runs that method
            ran = current_patch(model)
            if ran is not None:  # (its backends kept unless the patch's default: then the fast one)
                methods = dataclasses.replace(methods, attention=ran.method, layers=ran.layers,
                                              backend=None if ran.backend == DEFAULT_BACKEND else ran.backend,
                                              decode_backend=ran.decode_backend)
        methods = methods.with_default_backend(INFERENCE_BACKEND)
        if methods.attention is None and recorded_method(model) is None and (
                static_rope_bases(model) is not None if methods.rope is None
                else not ROPE_TYPES[methods.rope.rope_type].length_dependent):
            # a hybrid local/global model as loaded (Gemma 3), exactly, on lcx's fastest exact
            # backend: the sliding layers their own window in O(T * w) instead of transformers'
            # masked O(T^2) pass, the global layers causal (`lcx.hf.attention_patch.as_loaded_method`;
            # only for a static RoPE basis: HF's length-dependent rope rotates each key once, at
            # the basis of the call that computed it, which an attention method does not)
            from ..hf.attention_patch import as_loaded_method

            fast = as_loaded_method(model, INFERENCE_BACKEND)
            if fast is not None:
                methods = dataclasses.replace(methods, attention=fast, backend=INFERENCE_BACKEND, layers="global")
        # what was applied, resolved once (`lcx.hf.applied.Applied`): the RoPE spec, the lengths,
        # what each layer runs, its window and RoPE basis, the backends the patch runs
        self.applied = applied = methods.apply(model)
        recorded = applied.recorded is not None
        if recorded:
            # none asked for: the model's own attention method, when its config records one (a
            # model trained with it, e.g. SWAT), bounded like one asked for (not applied: the
            # model already runs it, per row on `lcx_key_positions` like a patched model)
            own = applied.recorded
            methods = dataclasses.replace(methods, attention=own.attention, backend=own.backend,
                                          decode_backend=own.decode_backend)
        elif methods.attention is not None and (applied.backend, applied.decode_backend) != (
                methods.backend or DEFAULT_BACKEND, methods.decode_backend):
            # the backends the patch runs where they are not those asked for (a soft-capping
            # model's calls go to one that can cap them: `lcx.hf.attention_patch.patch_attention`),
            # so the engine states what it runs
            methods = dataclasses.replace(methods, backend=applied.backend, decode_backend=applied.decode_backend)
        # what the engine runs: the config applied, plus the attention method the model records
        self.methods: MethodConfig = methods
        self._recorded = recorded
        # what each layer runs (the method, a hybrid model's own windows), its cache layout, and
        # the union of the layers' windows (what a row's held KV keeps between prefill calls)
        self._layer_methods = list(applied.layer_methods)
        self._rope_spec = applied.rope
        self.cache_layout: KVLayout = _kv_layout(model, applied, methods.decode_backend)
        self._hook = self.cache_layout.rotated and methods.attention is None
        # a model as loaded with sliding-window layers that `as_loaded_method` leaves as loaded
        # (Mistral's one window; a hybrid such as Gemma 3 under a length-dependent RoPE): for every
        # prefill transformers builds a [T, T] mask and runs the masked SDPA over all T keys
        windowed = windowed_rows(model, INFERENCE_BACKEND) if methods.attention is None else None
        # per layer, the window the model runs as loaded, where its prefill calls run per row on
        # lcx's backend (`lcx.hf.attention_patch.loaded_rows`; None: the model's own masked call):
        # those continuing from held keys, and for a windowed model whole prompts too (O(T * w))
        self._loaded_rows = windowed if windowed is not None else (
            _loaded_rows_windows(model, INFERENCE_BACKEND) if self._hook else None)
        self._whole_prompt_rows = windowed is not None
        if self._hook or self._loaded_rows is not None:
            from ..hf.attention_patch import install_decode_hook

            install_decode_hook(model)  # decode steps (rotated layout) and `loaded_rows` calls
        self.max_model_len = int(config.max_model_len or applied.context_len)
        # attention methods run per row on the row's own keys (`lcx_key_positions`), not on a mask
        self._row_attention = methods.attention is not None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = int(model.config.vocab_size)
        eos = getattr(model.config, "eos_token_id", None)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or eos
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        self.eos_ids = eos_ids
        self.pad_id = int(next(iter(sorted(eos_ids)), 0) if tokenizer.pad_token_id is None
                          else tokenizer.pad_token_id)
        self.stats = EngineStats()
        self._waiting: list[_Seq] = []
        self._prefilling: list[_Seq] = []  # admitted, prompt partly prefilled (chunked prefill)
        # prefix reuse and chunked prefill (`lcx.engine.prefix`): why not, or None
        self.prefix_cache_refusal: str | None = reuse_refusal(methods, applied.bases is not None)
        self._window = applied.kv_window
        # an unpatched model with its own sliding windows: a prefill continuing from held KV
        # gets masks built from positions per layer type (HF's mask slots by index)
        self._own_windows = loaded_windows(model) if methods.attention is None else None
        self._chunkable = self.prefix_cache_refusal is None and not (
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
        self._next_id = 0
        self._ids: set[str] = set()
        # Running batch: its requests and their KV cache (`lcx.engine.kv.KVStore`; None when idle)
        self._seqs: list[_Seq] = []
        self._store: ModelKV | None = None
        self._detok = Detokenizer(tokenizer)

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
        seq = _Seq(request_id, prompt_ids, params, self.eos_ids)
        seq.group = group if group is not None else request_id
        self._waiting.append(seq)
        return request_id

    def abort(self, request_id: str) -> StepEvent | None:
        """Drop a waiting or running request; returns its final event (None if unknown)."""
        for i, s in enumerate(self._waiting):
            if s.rid == request_id:
                del self._waiting[i]
                return self._finish_event(s, "abort")
        for s in self._prefilling:
            if s.rid == request_id:
                self._prefilling.remove(s)
                s.kv = None
                return self._finish_event(s, "abort")
        for i, s in enumerate(self._seqs):
            if s.rid == request_id:
                ev = self._finish_event(s, "abort")
                self._drop_rows([i])
                return ev
        return None

    def reset(self) -> list[str]:
        """Drop every waiting and running request (after an unexpected failure); returns their ids."""
        ids = [s.rid for s in self._waiting + self._prefilling + self._seqs]
        self._waiting, self._prefilling = [], []
        self._seqs, self._store = [], None
        self._ids.clear()
        return ids

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._seqs) + len(self._prefilling)

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._seqs)

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
        """The order `generate` submits `prompts` in: with the prefix cache, the prompt sharing
        the most with the others first (a passkey sweep's deepest needle: every other prompt
        shares the instruction and the haystack up to its own needle with it), so the others,
        admitted a step later (`_shares_uncached`), reuse it; else as given. Outputs keep the
        caller's order; tokens are the same either way (the cache is exact)."""
        n = len(prompts)
        if self.prefix_cache is None or n < 2:
            return list(range(n))
        chains = _block_chains(prompts, self.config.prefix_block_size)
        score = [sum(_shared_blocks(chains[i], chains[j]) for j in range(n) if j != i) for i in range(n)]
        lead = max(range(n), key=lambda i: (score[i], -i))
        return [lead] + [i for i in range(n) if i != lead]

    def forward_scope(self, input_ids: torch.Tensor) -> contextlib.AbstractContextManager:
        """The context for a plain forward of this engine's model over whole rows `input_ids`
        `[B, T]` (no cache, each row at positions 0..T-1, right padding read as tokens: how the
        `lcx` lm-eval model scores loglikelihoods): `windowed_rows_scope` for a windowed model as
        loaded, as the engine's own prefill runs it; nothing otherwise."""
        if not self._whole_prompt_rows:
            return contextlib.nullcontext()
        self._check_hook()
        return _whole_rows(self.model, input_ids, self._loaded_rows, INFERENCE_BACKEND)

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
        order = self._reuse_order(prompts)
        if self.prefix_cache is None or len(prompts) < 3:
            return order
        chains = _block_chains(prompts, self.config.prefix_block_size)
        chain, left = [order[0]], sorted(order[1:])
        while left:
            prev = chains[chain[-1]]
            nxt = max(left, key=lambda j: (_shared_blocks(prev, chains[j]), -j))
            chain.append(nxt)
            left.remove(nxt)
        return chain

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> list[StepEvent]:
        """Admit waiting requests (one batched prefill), decode one token for the running ones.

        Returns one event per request that produced something or finished. A failure confined
        to one request (its prefill, sampling or detokenisation) fails that request only.
        """
        events: list[StepEvent] = []
        self._check_hook()
        if self._seqs:
            t0 = time.perf_counter()
            events += self._decode_step()
            self.stats.decode_s += time.perf_counter() - t0
        work = self._schedule_prefill()
        if work:
            t0 = time.perf_counter()
            events += self._prefill(work)
            self.stats.prefill_s += time.perf_counter() - t0
        for ev in events:
            if ev.finished:
                self._ids.discard(ev.request_id)
        return events

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> list[tuple[_Seq, int]]:
        """This step's prefill work: (request, prompt tokens to prefill now); see "Fair service"
        in the module docstring. Without a token budget: every waiting request that has a batch
        slot, its whole prompt. With `max_num_batched_tokens`: the budget left after this step's
        decode rows goes first to the oldest partly prefilled prompt (a block: it always
        progresses), then shortest remaining prompt first, the rest back to that oldest prompt."""
        budget = self.config.max_num_batched_tokens
        left = float("inf") if budget is None else budget - len(self._seqs)
        admit = self._admissible()
        if budget is None:
            for s in admit:
                self._start(s)
            return [(s, len(s.prompt_ids) - s.done) for s in self._prefilling]
        grant: dict[int, int] = {}  # id(seq) -> tokens this step
        oldest = self._prefilling[0] if self._prefilling else None
        if oldest is not None:
            grant[id(oldest)] = c = self._chunk(oldest, min(left, self.config.prefix_block_size), first=True)
            left -= c
        for s in sorted(self._prefilling[1:] + admit, key=lambda x: len(x.prompt_ids) - x.done):
            c = self._chunk(s, left, first=not grant)
            if not c:
                continue
            if s not in self._prefilling:
                self._start(s)
            grant[id(s)] = c
            left -= c
        if oldest is not None and left > 0:  # the rest of the budget back to the oldest prompt
            more = self._chunk_extra(oldest, grant[id(oldest)], left)
            grant[id(oldest)] += more
        return [(s, grant[id(s)]) for s in self._prefilling if grant.get(id(s))]

    def _admissible(self) -> list[_Seq]:
        """Waiting requests that may take a batch slot now (looked up in the prefix cache), fairly
        across groups: the group holding the fewest slots first (FIFO among equals), and no group
        holds more than max_batch - max(1, max_batch // 8) slots (max_batch >= 2), so a new
        client's request finds a slot at once beside a heavy one (n = 256 samples)."""
        free = self.config.max_batch - len(self._seqs) - len(self._prefilling)
        if free <= 0 or not self._waiting:
            return []
        held: dict[str, int] = {}
        for x in self._seqs + self._prefilling:
            held[x.group] = held.get(x.group, 0) + 1
        cap = self.config.max_batch
        if cap >= 2:
            cap -= max(1, cap // 8)
        out: list[_Seq] = []
        order = sorted(range(len(self._waiting)), key=lambda i: (held.get(self._waiting[i].group, 0), i))
        for i in order:
            if len(out) == free:
                break
            s = self._waiting[i]
            if held.get(s.group, 0) >= cap and (out or self._seqs or self._prefilling):
                continue
            if not s.looked_up and self._shares_uncached(s, out):
                continue  # next step it reuses what an earlier request computes now
            held[s.group] = held.get(s.group, 0) + 1
            if not s.looked_up:
                s.looked_up = True
                self._lookup(s)
            out.append(s)
        return out

    def _shares_uncached(self, s: _Seq, admitted: list[_Seq]) -> bool:
        """Whether `s` shares a whole block of prompt, beyond what that request reuses from the
        cache, with a request admitted this step: its prefill stores the block, so `s` waits one
        step and reuses it (a burst of requests with one system prompt computes it once; results
        unchanged: the cache is exact)."""
        if self.prefix_cache is None or s.params.prompt_logprobs is not None:
            return False
        bs = self.config.prefix_block_size
        a = s.prompt_ids
        for o in admitted:
            b = o.prompt_ids
            limit = min(len(a), len(b)) - 1  # blocks below each prompt's last token
            n = o.done
            if n + bs > limit or a[:n + bs] != b[:n + bs]:
                continue
            return True
        return False

    def _start(self, s: _Seq) -> None:
        self._waiting.remove(s)
        self._prefilling.append(s)

    def _chunk_extra(self, s: _Seq, have: int, left: float) -> int:
        rest = len(s.prompt_ids) - s.done - have
        if rest <= left:
            return rest
        if not self._chunkable:
            return 0
        bs = self.config.prefix_block_size
        return int(left) // bs * bs

    def _chunk(self, s: _Seq, left: float, *, first: bool) -> int:
        """Prompt tokens of `s` to prefill with `left` tokens of budget (0: none this step). A
        step always makes progress: the first work item gets at least a block. A chunk that does
        not end the prompt is whole blocks, so every prompt's progress stays on the prefix
        cache's block grid: a chunk ending inside a block would leave that block unstored (each
        call stores the blocks it computes whole) and every later block of the prompt unreachable."""
        rest = len(s.prompt_ids) - s.done
        if rest <= left:
            return rest
        if not self._chunkable:  # one call for the whole remainder (`lcx.engine.prefix`)
            return rest if first else 0
        bs = self.config.prefix_block_size
        c = int(max(left, 0)) // bs * bs
        if c <= 0:
            return min(rest, bs) if first else 0
        return c

    def _lookup(self, s: _Seq) -> None:
        """Reuse the longest cached prefix of a new request's prompt (`lcx.engine.prefix`)."""
        if self.prefix_cache is None or s.params.prompt_logprobs is not None:
            return
        n, row = self.prefix_cache.lookup(s.prompt_ids, self._window)
        st = self.stats
        st.prefix_cache_queries += 1
        st.prefix_cache_query_tokens += len(s.prompt_ids) - 1
        if n:
            s.kv, s.done, s.cached = row, n, n
            st.prefix_cache_hits += 1
            st.prefix_cache_hit_tokens += n

    def _prefill(self, work: list[tuple[_Seq, int]]) -> list[StepEvent]:
        seqs = [s for s, _ in work]
        try:
            keys, values, pos, h = self._prefill_forward(work)
        except Exception as e:  # noqa: BLE001 - isolate: retry one by one, fail only the culprits
            if len(work) == 1:
                log.exception("prefill failed for request %s", seqs[0].rid)
                self._prefilling.remove(seqs[0])
                self._finish(seqs[0], "error", error=e)
                return [self._event(seqs[0])]
            log.warning("batched prefill of %d requests failed (%s); retrying one by one", len(seqs), e)
            return [ev for w in work for ev in self._prefill([w])]
        self.stats.prefill_batches += 1
        self.stats.prefill_chunks += sum(1 for s, _ in work if s.done > s.cached)
        self.stats.prompt_tokens_computed += sum(c for _, c in work)
        C = h.shape[1]
        N = pos.shape[1] - C  # held slots before the new tokens
        events: list[StepEvent] = []
        keep: list[int] = []
        ends = [i for i, (s, c) in enumerate(work) if s.done + c == len(s.prompt_ids) and s.params.max_tokens > 0]
        logits = self._lm_head(h[ends, -1]) if ends else None  # [e, V]
        for i, (s, c) in enumerate(work):
            start, T = s.done, len(s.prompt_ids)
            try:
                if self.prefix_cache is not None:
                    self.prefix_cache.insert(s.prompt_ids, start, [k[i, :, N + C - c:] for k in keys],
                                             [v[i, :, N + C - c:] for v in values])
                if s.params.prompt_logprobs is not None:
                    rows = h[i, C - c:] if start + c < T else h[i, C - c:-1]  # predict tokens start+1 ...
                    if rows.shape[0]:
                        s.plog += logprob_rows(self._lm_head(rows), s.prompt_ids[start + 1:start + 1 + rows.shape[0]],
                                               s.params.prompt_logprobs)
                s.done = start + c
                if s.done < T:  # continue next step from the kept slots
                    valid = pos[i] >= 0
                    if len(work) == 1 and bool(valid.all()):  # views of this call's cache, no copy
                        s.kv = RowKV([k[0] for k in keys], [v[0] for v in values], pos[0])
                    else:
                        idx = valid.nonzero().squeeze(1)
                        s.kv = RowKV([k[i].index_select(1, idx) for k in keys],
                                     [v[i].index_select(1, idx) for v in values], pos[i, idx])
                    s.kv = s.kv.kept(s.done, self._window)
                    continue
                self._prefilling.remove(s)
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
                if s in self._prefilling:
                    self._prefilling.remove(s)
                self._finish(s, "error", error=e)
                events.append(self._event(s))
        if keep:
            self._merge([seqs[i] for i in keep], [k[keep] for k in keys], [v[keep] for v in values], pos[keep])
        return events

    def _prefill_forward(self, work: list[tuple[_Seq, int]]):
        """One batched prefill call: each request's next `c` prompt tokens (left-padded to the
        longest), continuing from its held KV (left-padded before them, `lcx.engine.prefix`).
        Returns keys, values (per layer [b, H_kv, N + C, D]: held slots then new ones), pos
        [b, N + C] (-1 on padding) and the new tokens' final hidden states [b, C, d]."""
        from transformers.cache_utils import DynamicCache

        b, C = len(work), max(c for _, c in work)
        ids = torch.full((b, C), self.pad_id, dtype=torch.long)
        qpos = torch.full((b, C), -1, dtype=torch.long)
        for i, (s, c) in enumerate(work):
            ids[i, C - c:] = torch.tensor(s.prompt_ids[s.done:s.done + c])
            qpos[i, C - c:] = torch.arange(s.done, s.done + c)
        ids, qpos = ids.to(self.device), qpos.to(self.device)
        n_layers = len(self._decoder.layers)
        held_k, held_v, kpos = stack_rows([s.kv for s, _ in work], n_layers, None)
        kpos = kpos.to(self.device)
        cache = DynamicCache() if held_k is None else hf_cache(held_k, held_v)
        pos = torch.cat([kpos, qpos], 1)  # [b, N + C]
        if self._loaded_rows is not None and (held_k is not None or self._whole_prompt_rows):
            # a model as loaded continuing from held keys (or a windowed one, any prefill): per row
            # on lcx's backend, no mask (`lcx.hf.attention_patch.loaded_rows`; the model's own
            # call would be a masked pass)
            from ..hf.attention_patch import loaded_rows

            with loaded_rows(pos, self._loaded_rows, INFERENCE_BACKEND):
                out = self._decoder(input_ids=ids, position_ids=qpos.clamp(min=0), past_key_values=cache,
                                    use_cache=True)
        else:
            out = self._decoder(input_ids=ids, position_ids=qpos.clamp(min=0), past_key_values=cache, use_cache=True,
                                **self._mask_kwargs(pos >= 0, pos, n_new=C if held_k is not None else 0))
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return keys, values, pos, out.last_hidden_state

    def _mask_kwargs(self, mask: torch.Tensor, pos: torch.Tensor | None, *, n_new: int = 0) -> dict[str, Any]:
        """Visibility of the cached + new slots for the model's forward: a 2D attention mask, or
        for attention methods the per-row key positions (-1 where not visible). An unpatched
        model with its own sliding windows continuing from held KV (`n_new` new slots after the
        held ones; padding between them, where HF's masks, by slot index, would shift a window):
        4D masks from the positions (`_position_masks`)."""
        if self._row_attention:
            return {"lcx_key_positions": pos.masked_fill(~mask, -1)}
        if n_new and self._own_windows is not None and any(w is not None for w in self._own_windows):
            return {"attention_mask": _position_masks(self.model, self._own_windows, pos.masked_fill(~mask, -1),
                                                      n_new, self.dtype)}
        return {"attention_mask": mask.long()}

    # ------------------------------------------------------------------ decode
    def _decode_step(self) -> list[StepEvent]:
        B = len(self._seqs)
        self.stats.decode_steps += 1
        self.stats.batch_size_hist[B] = self.stats.batch_size_hist.get(B, 0) + 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, B)
        try:
            logits = self._decode_forward(self._store, self._seqs)
            failed: dict[int, BaseException] = {}
        except Exception as e:  # noqa: BLE001 - isolate: run rows one by one, fail only the culprits
            if B == 1:
                logits, failed = None, {0: e}
            else:
                log.warning("batched decode of %d rows failed (%s); retrying row by row", B, e)
                logits, failed = self._decode_rows_separately()
        events: list[StepEvent] = []
        done: list[int] = []
        greedy, lps = greedy_and_logprobs(logits, self._seqs) if logits is not None else (None, None)
        for i, s in enumerate(self._seqs):
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

    def _decode_forward(self, store: ModelKV, seqs: list[_Seq]) -> torch.Tensor:
        """One decode forward of `seqs` (the rows of `store`, in order): feeds each row's last
        sampled token at its position, writes its key/value into `store` and returns logits
        `[b, V]`. Fast path (`store.layout.rotated`): one `ModelStep` handed to every layer (each
        attends with its layer group's `DecodeStep`).
        General path: each row's visible keys gathered in position order into an HF cache for
        the method's own attention (`lcx_key_positions`), the new column written back after."""
        ids = torch.tensor([[s.out_ids[-1]] for s in seqs], device=self.device)  # [b, 1]
        p_q = torch.tensor([s.next_position for s in seqs], device=self.device)  # [b]
        if store.layout.rotated:  # (step() checked the hook: _check_hook)
            step = store.decode_step(p_q, self.dtype)
            out = self._decoder(input_ids=ids, position_ids=p_q[:, None], use_cache=False, lcx_decode=step)
            return self._lm_head(out.last_hidden_state[:, -1])  # [b, V]
        store = store.only  # the general path: one layout on every layer
        keys, values, kpos = store.gathered(p_q)  # [b, Hkv, T, D], [b, T]
        cache = hf_cache(keys, values)
        kpos = torch.cat([kpos, p_q[:, None]], 1)  # [b, T+1]
        out = self._decoder(input_ids=ids, position_ids=p_q[:, None], past_key_values=cache, use_cache=True,
                            **self._mask_kwargs(kpos >= 0, kpos))
        logits = self._lm_head(out.last_hidden_state[:, -1])
        store.write_unrotated(store.step(p_q), [layer.keys[:, :, -1] for layer in cache.layers],
                              [layer.values[:, :, -1] for layer in cache.layers])
        return logits

    def _check_hook(self) -> None:
        """The fast path needs every attention layer to take `lcx_decode`: the patch's forward, or
        the hook installed at start-up (re-installed if an unpatch removed it). Raises if the
        model's attention or RoPE patch is no longer the one the engine applied (every step)."""
        from ..hf.attention_patch import current_patch, has_decode_hook, install_decode_hook, layer_methods
        from ..hf.rope_patch import current_spec

        patched = current_patch(self.model) is not None
        if patched != (self.methods.attention is not None and not self._recorded) or (
                patched and layer_methods(self.model) != self._layer_methods):
            raise RuntimeError("the model's attention patch changed after the engine was built; build a new Engine")
        if current_spec(self.model) != self._rope_spec:
            raise RuntimeError("the model's RoPE patch changed after the engine was built (e.g. lcx.unpatch); "
                               "build a new Engine")
        if not patched and not has_decode_hook(self.model):
            install_decode_hook(self.model)

    def _decode_rows_separately(self):
        """Fallback after a failed batched decode: one forward per row on its own copy of the
        cache, the copies then stacked back. Failed rows get zero logits (never read: they are
        dropped right after)."""
        B = len(self._seqs)
        failed: dict[int, BaseException] = {}
        parts: list[ModelKV] = []
        logits: list[torch.Tensor | None] = []
        for i in range(B):
            sub = self._store.rows([i])
            try:
                logits.append(self._decode_forward(sub, [self._seqs[i]]))
            except Exception as e:  # noqa: BLE001
                failed[i] = e
                logits.append(None)
            parts.append(sub)
        self._store = ModelKV.cat(parts)
        ok = [x for x in logits if x is not None]
        if not ok:
            return None, failed
        return torch.cat([x if x is not None else torch.zeros_like(ok[0]) for x in logits]), failed

    # ------------------------------------------------------------------ batch surgery
    def _merge(self, seqs: list[_Seq], keys, values, pos) -> None:
        """Append prefilled rows (their prefill call's cache, pos -1 on padding) to the running batch."""
        budget = torch.tensor([len(s.prompt_ids) + s.params.max_tokens for s in seqs])
        new = ModelKV.from_prefill(self.cache_layout, keys, values, pos, budget)
        self._store = new if self._store is None else ModelKV.cat([self._store, new])
        self._seqs += seqs

    def _drop_rows(self, rows: list[int]) -> None:
        keep = [i for i in range(len(self._seqs)) if i not in set(rows)]
        if not keep:
            self._seqs, self._store = [], None
            return
        self._seqs = [self._seqs[i] for i in keep]
        self._store = self._store.rows(keep)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the running batch's cached keys and values (0 when idle): the allocated
        slots of every row (`lcx.engine.kv`)."""
        return 0 if self._store is None else self._store.nbytes()

    @property
    def cache_len(self) -> int:
        """Slots per row of the running batch's KV cache in its widest layer (0 when idle)."""
        return 0 if self._store is None else self._store.slots

    @property
    def layer_cache_lens(self) -> list[int]:
        """Slots per row of each layer's KV cache (zeros when idle): a hybrid model's sliding
        layers hold their window, whatever the length (`lcx.engine.kv`)."""
        return [0] * self.cache_layout.n_layers if self._store is None else self._store.layer_slots()

    @property
    def layer_windows(self) -> list[tuple[int, int] | None]:
        """Per layer, (n_first, n_recent): the keys its query sees are among the first n_first and
        the last n_recent (its method's `cache_window`; a layer running its own sliding window w:
        (0, w)), or None: every key."""
        return list(self.applied.layer_windows)

    @property
    def layer_kv_cache_bytes(self) -> list[int]:
        """Bytes of each layer's cached keys and values (zeros when idle)."""
        return [0] * self.cache_layout.n_layers if self._store is None else self._store.layer_nbytes()

    # ------------------------------------------------------------------ logits, tokens, events
    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        logits = head_logits(self.model, h)  # lm_head and the family's soft-cap / scaling, as its forward
        # Logprobs and sampling in at least float32 (bf16/fp16 logits are too coarse).
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def _sample(self, s: _Seq, logits: torch.Tensor, greedy: int | None = None) -> int:
        return sample(s, logits, greedy)

    def _accept(self, s: _Seq, logits: torch.Tensor, ev: StepEvent, *, greedy: int | None = None,
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

    def _finish(self, s: _Seq, reason: str, *, stop_reason: str | int | None = None,
                error: BaseException | None = None) -> None:
        s.finished, s.finish_reason, s.stop_reason, s.error = True, reason, stop_reason, error
        self.stats.finished[reason] += 1

    def _fill_event(self, s: _Seq, ev: StepEvent) -> None:
        """Move newly stable text into `ev` and copy the finish state."""
        end = len(s.text) if s.finished else stable_end(s.text, s.sent, s.params.stop)
        if end > s.sent:
            ev.text = s.text[s.sent:end]
            s.sent = end
        ev.finished, ev.finish_reason, ev.stop_reason, ev.error = s.finished, s.finish_reason, s.stop_reason, s.error

    def _event(self, s: _Seq) -> StepEvent:
        ev = StepEvent(s.rid)
        if s.finish_reason != "error":
            self._fill_event(s, ev)
        else:
            ev.finished, ev.finish_reason, ev.error = True, "error", s.error
        return ev

    def _finish_event(self, s: _Seq, reason: str) -> StepEvent:
        self._finish(s, reason)
        self._ids.discard(s.rid)
        return self._event(s)


def _kv_layout(model: nn.Module, applied: Any, decode_backend: str | None) -> KVLayout:
    """The engine's `KVLayout` for a model and what `MethodConfig.apply` ran on it (`applied`,
    `lcx.hf.applied.Applied`: each layer's method, window and RoPE basis; `lcx.engine.kv`).

    The fast path (keys rotated once, per group of layers running the same method on the same
    RoPE basis): unpatched models (every layer as loaded; layers with their own sliding window a
    ring of that window) and every layer's method with a `DecodeRule`. The general path, one
    layout for every layer keeping the union of the layers' windows, when some layer's method has
    no rule (SWAT), the RoPE basis changes with the length (dynamic NTK, longrope: a key rotated
    once would keep an old basis, which an attention method's reference does not do), an explicit
    `decode_backend` asks for the method's own attention, or the method is one a model records
    (it runs its own attention forward)."""
    from ..hf.attention_patch import channel_order
    from ..hf.rope_patch import layer_rope_types

    per_layer = applied.layer_methods
    n = len(per_layer)
    if all(m is None for m in per_layer):
        groups: dict[Any, list[int]] = {}
        for i, w in enumerate(applied.layer_windows):
            groups.setdefault(None if w is None else w[1], []).append(i)
        return KVLayout(tuple((CacheLayout.unpatched() if w is None else CacheLayout.own_window(w), tuple(g))
                              for w, g in groups.items()))
    bases = applied.bases
    if (applied.recorded is not None or decode_backend is not None or bases is None
            or any(m.decode_rule() is None for m in per_layer)):
        return KVLayout.single(CacheLayout.general(_union_window([m.cache_window for m in per_layer])), n)
    types_ = layer_rope_types(model)
    by_key: dict[Any, list[int]] = {}
    for i, m in enumerate(per_layer):
        by_key.setdefault((m, types_[i]), []).append(i)
    order = channel_order(model)  # the family's channel layout (lcx.hf.channel_order)
    return KVLayout(tuple((CacheLayout.for_method(m, basis=bases[g[0]], order=order), tuple(g))
                          for (m, _), g in by_key.items()))


def windowed_rows(model: nn.Module, backend: str = INFERENCE_BACKEND) -> tuple[int | None, ...] | None:
    """Per layer, the window of a model as loaded (no attention method applied) with
    sliding-window layers, when `lcx.hf.attention_patch.loaded_rows` can run its calls on
    `backend` (`_loaded_rows_windows`); else None. Such a model prefills per row on `backend`
    in the engine (every prompt) and in `windowed_rows_scope`: a hybrid under a length-dependent
    RoPE, which `as_loaded_method` leaves as loaded, or Mistral's one window."""
    from ..hf.attention_patch import current_patch

    if current_patch(model) is not None or all(w is None for w in loaded_windows(model)):
        return None
    return _loaded_rows_windows(model, backend)


def windowed_rows_scope(model: nn.Module, input_ids: torch.Tensor,
                        backend: str = INFERENCE_BACKEND) -> contextlib.AbstractContextManager:
    """For a model `windowed_rows` names: a context in which its forward over whole rows
    `input_ids` `[B, T]` (no cache, positions 0..T-1) attends per row on `backend`, each layer
    causal or its own window, with no [T, T] mask built (the decode hook installed for the scope
    if the model has none); the same attention as its own masked call, as the engine prefills
    it. A no-op context for any other model."""
    windows = windowed_rows(model, backend)
    return contextlib.nullcontext() if windows is None else _whole_rows(model, input_ids, windows, backend)


@contextlib.contextmanager
def _whole_rows(model: nn.Module, input_ids: torch.Tensor, windows: tuple[int | None, ...], backend: str):
    from ..hf.attention_patch import remove_decode_hook, has_decode_hook, install_decode_hook, loaded_rows

    installed = not has_decode_hook(model)
    if installed:
        install_decode_hook(model)
    B, T = input_ids.shape
    try:
        with loaded_rows(torch.arange(T, device=input_ids.device).expand(B, T), windows, backend):
            yield
    finally:
        if installed:
            remove_decode_hook(model)


def _loaded_rows_windows(model: nn.Module, backend: str) -> tuple[int | None, ...] | None:
    """Per layer, the window an unpatched model runs as loaded (`lcx.hf.attention_patch.loaded_windows`), when
    `lcx.hf.attention_patch.loaded_rows` can run its prefill calls on `backend` (the backend
    `supports()` them on the model's device, dtype and heads; soft-capped calls, Gemma 2's, on
    `blockwise` where `backend` cannot cap), else None."""
    from ..attention import BACKENDS, AttentionSpec, backend_for
    from ..hf import attention_softcap
    from ..hf.attention_patch import model_call_info
    from ..masks import causal_mask
    from ..masks import sliding_window as sliding_window_mask

    if backend not in BACKENDS:
        return None
    windows = tuple(loaded_windows(model))
    call = model_call_info(model, n_queries=2, n_keys=4, q_offset=2)
    softcap = attention_softcap(model)
    for w in set(windows):
        spec = AttentionSpec(mask=causal_mask if w is None else sliding_window_mask(left=w - 1), softcap=softcap)
        if BACKENDS[backend_for(backend, spec)].supports(spec, call) is not None:
            return None
    return windows


def _position_masks(model: nn.Module, windows: list[int | None], pos: torch.Tensor, n_new: int,
                    dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive 4D masks `[b, 1, C, N + C]` of a prefill call from its slots' positions `pos`
    `[b, N + C]` (-1: padding; the C = n_new new tokens last): a query sees the keys at positions
    <= its own, within its layer's window (the query and the w - 1 before it, as transformers'
    sliding masks); a padding query sees itself only (never read, but finite). One mask when
    every layer has the same window, else {layer type: mask} (hybrid models take a mask per
    layer type)."""
    from ..hf import layer_types

    T = pos.shape[1]
    q = pos[:, -n_new:, None]  # [b, C, 1]
    k = pos[:, None, :]  # [b, 1, T]
    seen = (k >= 0) & (k <= q)  # [b, C, T]
    own = torch.zeros(n_new, T, dtype=torch.bool, device=pos.device)
    own[torch.arange(n_new), T - n_new + torch.arange(n_new)] = True
    own = own[None] & (q < 0)
    neg = torch.finfo(dtype).min

    def mask(w: int | None) -> torch.Tensor:
        vis = (seen if w is None else seen & (k > q - w)) | own
        return torch.zeros(vis.shape, dtype=dtype, device=pos.device).masked_fill_(~vis, neg)[:, None]

    if len(set(windows)) == 1:
        return mask(windows[0])
    by_type: dict[str, int | None] = {}
    for t, w in zip(layer_types(model), windows):
        if by_type.setdefault(t, w) != w:
            raise ValueError(f"layers of type {t!r} run different windows; cannot mask them per layer type")
    return {t: mask(w) for t, w in by_type.items()}


def _union_window(windows: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """(n_first, n_recent) covering every layer's window (None if a layer keeps every key)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w[0] for w in windows), max(w[1] for w in windows)


def _block_chains(prompts: list[Sequence[int]], bs: int) -> list[list[int]]:
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


def _shared_blocks(a: list[int], b: list[int]) -> int:
    """How many leading blocks two `_block_chains` entries share (binary search: the chain makes
    equality a prefix property)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_static_bases = static_rope_bases  # (the name benchmarks/prefill.py imports)
