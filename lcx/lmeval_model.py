"""The `lcx` model for lm-eval: any model `lcx.load_model` loads, with lcx methods applied.

    lm_eval --model lcx --tasks passkey,lcx_ppl \\
        --model_args pretrained=tiny-5m,rope_type=yarn,factor=4 \\
        --metadata '{"max_seq_lengths": [256, 512, 1024]}'

`pretrained` is anything `lcx.load_model` accepts: a local Hugging Face directory, a `.gguf`
file, a preset (`tiny-ret-5m`, `tiny-5m`, `smollm2-135m`, `gemma3-270m`, ...; `lcx models` lists
them), or a Hub id `org/name[@revision][:file.gguf]`, resolved through the Hugging Face cache as
transformers would (downloaded unless `HF_HUB_OFFLINE=1`; `lcx.models.hub`). `revision=R` (the
`hf` model's key) is the same as `pretrained=org/name@R`.

Methods come from `--model_args` keys:
- RoPE: `rope_type` and any other `RopeSpec` key (`factor`, `rope_theta`,
  `original_max_position_embeddings`, `beta_fast`, ..., lists as `short_factor=[...]`), Hugging
  Face names; unset keys come from the model (`lcx.patch`). RoPE keys without `rope_type` are
  refused; with none the model runs as loaded.
- Attention (`attention=<name>` plus that method's keys): any method of the registry
  `lcx.methods.ATTENTION_METHODS` (`lcx serve --help` lists each with its keys, e.g.
  `attention=lm_infinite,n_global=10,n_local=256`); composable with any RoPE spec.
  `attn_backend` picks the `lcx.attention` backend of its calls (default `flash`: torch's fused
  flash kernels composed into the windowed mask, the fastest exact CPU route; `blockwise`,
  `sdpa`, `ref`, ...) and `attn_decode_backend` the one of single-token calls (default: the same).

The engine's prefix cache (`lcx.engine.prefix`: exact) is on (`prefix_caching=false` turns it
off); at batch size 1 `generate_until` runs the prompts in the order that reuses the most
(`Engine.reuse_chain`), and the cache's bound (`prefix_cache_mb`, default `auto`) is raised to
hold the longest prompt whole, since each prompt reuses the one before it (a 48k-token prompt of
Gemma-3-270m holds 1.8 GB of keys and values in float32, beyond the engine's 1 GiB default).

Everything else is lm-eval's HFLM (this class subclasses it with the model preloaded), which
does loglikelihood, loglikelihood_rolling and generate_until with the method in effect; the
tokens of generate_until come from `lcx.engine` (lcx's one decode loop: batched, with the
attention method's bounded per-row cache) instead of HF `generate` — HFLM still encodes,
truncates, stops and post-processes — and loglikelihoods are scored in chunks of tokens from the
hidden states (`lcx.eval.loss`: no `[batch, length, vocab]` logits, 17 GB for 16k tokens of
Gemma 3) with HFLM's order, truncation, caching and answers. Generation kwargs the engine does not take (beam search,
`num_beams`, ...) raise `ValueError` naming them. One more difference: HFLM truncates inputs
to the model's `max_position_embeddings`; here `max_length` defaults to `DEFAULT_MAX_LENGTH` (2**20 tokens), so prompts beyond the original context reach
the model whole, which is the point of extrapolation. With `max_length=N`, a request longer than N
(a prompt with its `max_gen_toks`, a log-likelihood request, a perplexity document) raises
`lcx.truncation.PromptTooLongError` where HFLM would left-truncate it and score a shorter
prompt than the task asked for; `allow_truncation=true` restores HFLM's cut. `batch_size=auto`
probes memory at `max_length` and so needs an explicit, realistic `max_length`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from lcx.engine import Engine, EngineConfig, SamplingParams
from lcx.engine.params import megabytes_or_auto
from lcx.method_config import INFERENCE_BACKEND, ROPE_KEYS, MethodConfig
from lcx.methods.registry import ATTENTION_METHODS

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 1 << 20


DEFAULT_ATTN_BACKEND = INFERENCE_BACKEND
# `generation_batch=N` decodes chunks of this many x N requests (what a killed run can lose)
GENERATION_CHUNK = 4

# HFLM arguments that still mean something with a preloaded model.
HFLM_KEYS = frozenset({
    "batch_size", "max_batch_size", "max_length", "truncation", "logits_cache", "add_bos_token",
    "prefix_token_id", "softmax_dtype", "mixed_precision_dtype", "think_end_token",
    "enable_thinking", "chat_template_args",
})
# Accepted and ignored: lm-eval adds trust_remote_code=True to model_args with --trust_remote_code;
# lcx.load_model never runs remote code.
IGNORED_KEYS = frozenset({"trust_remote_code"})


def split_model_args(kwargs: dict[str, Any]) -> tuple[MethodConfig, dict[str, Any]]:
    """Sort model_args into (the `lcx.MethodConfig` their method keys describe, HFLM kwargs).

    Method keys are `MethodConfig`'s flat form (RoPE keys, `attention=<name>` and its keys,
    `attn_backend`, `attn_decode_backend`); the attention backend defaults to `flash`. Raises
    `ValueError` for keys nobody accepts, listing the accepted ones.
    """
    methods, rest = MethodConfig.nest_flat(kwargs)
    hflm = {k: rest.pop(k) for k in list(rest) if k in HFLM_KEYS}
    for k in IGNORED_KEYS:
        rest.pop(k, None)
    if rest:
        raise ValueError(
            f"lcx model: unknown model_args {sorted(rest)}; accepted: pretrained, revision, dtype, device, "
            f"RoPE keys {sorted(ROPE_KEYS)}, attention=<{'|'.join(sorted(ATTENTION_METHODS))}> and its keys, "
            f"attn_backend, attn_decode_backend, lm-eval keys {sorted(HFLM_KEYS)}")
    try:  # the RoPE keys are checked once, by `lcx.rope.PartialRopeSpec` (e.g. a missing rope_type)
        cfg = MethodConfig.from_dict(methods)
    except ValueError as e:
        raise ValueError(f"lcx model: {e}") from None
    return cfg.with_default_backend(DEFAULT_ATTN_BACKEND), hflm


# HF generation kwargs lm-eval tasks send and what they mean for `SamplingParams`
_GEN_KWARGS = {"do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "attention_mask"}


def _sampling_params(kwargs: dict[str, Any], max_tokens: int, stop: list[str]) -> SamplingParams:
    """HF `generate` kwargs (lm-eval's `gen_kwargs`, normalised by HFLM) -> `SamplingParams`.
    Greedy unless `do_sample` (HF's rule: temperature alone does not sample)."""
    unknown = sorted(set(kwargs) - _GEN_KWARGS)
    if unknown:
        raise ValueError(f"lcx model: generation kwargs {unknown} are not supported by lcx.engine; "
                         f"supported: {sorted(_GEN_KWARGS - {'attention_mask'})}")
    sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
    return SamplingParams(
        max_tokens=max(0, max_tokens), stop=tuple(stop or ()),
        temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
        top_p=float(kwargs.get("top_p", 1.0)) if sample else 1.0,
        top_k=int(kwargs.get("top_k", 0) or 0) if sample else 0,
        min_p=float(kwargs.get("min_p", 0.0) or 0.0) if sample else 0.0,
        repetition_penalty=float(kwargs.get("repetition_penalty", 1.0)))


def _positive_int(name: str, value: int | str) -> int:
    """A positive integer model_arg (lm-eval passes ints parsed, or the string as typed)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"lcx model: {name} must be a positive integer, got {value!r}")
    return n


def _flag(name: str, value: bool | str) -> bool:
    """A boolean model_arg: lm-eval passes `True`/`False` parsed, or the string as typed."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ValueError(f"lcx model: {name} must be true or false, got {value!r}")


def _device(device: str | None) -> str:
    # lm-eval's CLI defaults to cuda:0; like HFLM, fall back to the CPU when there is no GPU.
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        log.info("device %r requested but CUDA is unavailable: using cpu", device)
        return "cpu"
    return device or "cpu"


def _with_revision(pretrained: str, revision: str | None) -> str:
    """`pretrained` with lm-eval's `revision=` model arg folded into the Hub id (`org/name@revision`)."""
    if revision is None:
        return pretrained
    from lcx.models.hub import HubId, parse_hub_id

    hub = parse_hub_id(pretrained)
    if hub is None or hub.revision is not None:
        raise ValueError(f"lcx model: revision={revision!r} needs pretrained to be a Hub id without its own "
                         f"@revision (org/name), got {pretrained!r}")
    return str(HubId(hub.repo_id, str(revision), hub.filename))


@register_model("lcx")
class LcxLM(HFLM):
    """lm-eval model `lcx`: `HFLM` over `lcx.load_model(pretrained)` with lcx methods applied."""

    def __init__(self, pretrained: str, dtype: str | torch.dtype = "float32", device: str | None = "cpu",
                 revision: str | None = None,
                 prefix_caching: bool | str = True, prefix_cache_mb: float | str | None = None,
                 generation_batch: int | str = 1, **kwargs: Any) -> None:
        import lcx
        from lcx.allocator import reuse_freed_memory

        from lcx import truncation

        self.lcx_allow_truncation = truncation.allow_truncation(kwargs.pop(truncation.ALLOW_KEY, False))
        cfg, hflm = split_model_args(kwargs)
        if not isinstance(pretrained, str):
            raise TypeError("lcx model: pretrained must be a path, preset name or Hub id (a string)")
        pretrained = _with_revision(pretrained, revision)
        dtype = torch.float32 if dtype in (None, "auto") else dtype
        prefix_caching = _flag("prefix_caching", prefix_caching)
        self.lcx_generation_batch = _positive_int("generation_batch", generation_batch)
        cache_mb = megabytes_or_auto("lcx model: prefix_cache_mb", prefix_cache_mb)
        reuse_freed_memory()  # `lm_eval --model lcx` is a process that runs a model (lcx.allocator)
        model, tokenizer = lcx.load_model(pretrained, dtype=dtype, device=_device(device))
        # the engine applies the methods (as `cfg.apply` would) and keeps them for HFLM's forwards
        self.lcx_engine = Engine(model, tokenizer, EngineConfig(
            methods=cfg, max_model_len=int(hflm.get("max_length") or DEFAULT_MAX_LENGTH),
            prefix_caching=prefix_caching,
            **({"max_batch": self.lcx_generation_batch} if self.lcx_generation_batch > 1 else {}),
            **({} if cache_mb is None else {"prefix_cache_bytes": int(cache_mb * (1 << 20))})))
        self.lcx_fit_prefix_cache = cache_mb is None  # auto: the bound holds a cell's longest prompt
        self.lcx_config = cfg
        self.lcx_spec = self.lcx_engine.applied.rope  # the RoPE spec apply() resolved against the model, or None
        if cfg.rope is not None:
            log.info("lcx model: %s", cfg.describe())
        self.lcx_attention = cfg.attention.name if cfg.attention is not None else None
        hflm.setdefault("max_length", DEFAULT_MAX_LENGTH)
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **hflm)
        self.pretrained = pretrained  # a name for lm-eval's results, not the model object

    def _check_lengths(self) -> dict[str, str] | None:
        """Where `max_length` came from and how to raise it, for `PromptTooLongError`; None when
        cut requests are allowed (`allow_truncation=true`)."""
        if self.lcx_allow_truncation:
            return None
        given = self.max_length != DEFAULT_MAX_LENGTH
        return {"limit_source": "max_length in --model_args" if given else "the lcx model's default",
                "raise_with": "a larger max_length= in --model_args, or leave it out: the lcx model's default is "
                              f"{DEFAULT_MAX_LENGTH:,} tokens"}

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        where = self._check_lengths()
        if where is not None and requests:  # HFLM keeps the last max_length - max_gen_toks prompt tokens
            from lm_eval.models.utils import normalize_gen_kwargs

            from lcx.truncation import check_generation

            budgets = [int(normalize_gen_kwargs(dict(r.args[1]), self.max_gen_toks)["max_gen_toks"]) for r in requests]
            _, masks = self.tok_batch_encode([r.args[0] for r in requests])
            lengths = [[0] * int(n) for n in masks.sum(dim=1).tolist()]  # the encoded lengths (ids not needed)
            check_generation(requests, lengths, budgets, self.max_length, **where)
        return self._generate_until(requests, disable_tqdm=disable_tqdm)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from lcx.truncation import task_names

        self.lcx_tasks = task_names(requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        where = self._check_lengths()
        if where is not None and requests:  # HFLM's windows hold max_length tokens
            from lcx.truncation import check_rolling, task_names

            check_rolling((len(self.tok_encode(r.args[0])) for r in requests), self.max_length,
                          tasks=task_names(requests), **where)
        self.lcx_tasks = None
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def _generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """HFLM's `generate_until`, at batch size 1 run one request at a time in the order
        `Engine.reuse_chain` gives (each prompt after the one it shares the most with: a passkey or
        RULER sweep's prompts of one length share the instruction and the haystack up to their
        needle), so the engine's prefix cache reuses that prefix instead of prefilling it again.
        Each request goes through HFLM's own code as before and the cache is exact, so the answers
        are the same as in HFLM's order (tests/eval_tasks/test_lmeval_reuse.py); other batch sizes
        keep HFLM's order and batching."""
        if self.batch_size != 1 or len(requests) < 2:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        if self.lcx_generation_batch > 1:
            return self._generate_batched(requests, disable_tqdm)
        if len(requests) < 3 or self.lcx_engine.prefix_cache is None:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        from tqdm import tqdm

        encoded = [self.tok_encode(r.args[0]) for r in requests]
        if self.lcx_fit_prefix_cache:  # each prompt reuses its predecessor: hold one of them whole
            self.lcx_engine.fit_prefix_cache(max(map(len, encoded)))
        order = self.lcx_engine.reuse_chain(encoded)
        out: list[Any] = [None] * len(requests)
        for i in tqdm(order, disable=(disable_tqdm or self.rank != 0), desc="Running generate_until requests"):
            out[i] = super().generate_until([requests[i]], disable_tqdm=True)[0]
        return out

    def _generate_batched(self, requests: list[Any], disable_tqdm: bool) -> list[str]:
        """`generation_batch=N`: the requests' tokens decoded together, up to N rows a step, then
        each request through HFLM's own `generate_until` as at batch size 1, its tokens taken from
        that run. Per chunk of `GENERATION_CHUNK` x N requests, three passes: (1) plan: each
        request through HFLM with the engine call recorded instead of run (its prompt ids and
        sampling parameters; lm-eval's cache hook off, so the journal never sees a planning
        answer); (2) one `Engine.generate` over the chunk's prompts (the engine orders them for its
        prefix cache, which persists across chunks, and batches their decode steps); (3) replay:
        each request through HFLM again, its `_model_generate` answered from (2), its answer
        journaled. A run killed mid-cell loses at most the chunk in progress. HFLM's encoding,
        truncation, stop handling and post-processing are untouched, so the answers are batch size
        1's wherever a batched decode step computes the same greedy tokens as a single-row one
        (tests/eval_tasks/test_lmeval_reuse.py compares them)."""
        from lm_eval.api.model import CacheHook
        from tqdm import tqdm

        size = GENERATION_CHUNK * self.lcx_generation_batch
        out: list[str] = []
        bar = tqdm(total=len(requests), disable=(disable_tqdm or self.rank != 0), desc="Running generate_until requests")
        for start in range(0, len(requests), size):
            chunk = requests[start:start + size]
            planned: list[tuple[list[int], SamplingParams]] = []
            self._lcx_generation_mode = ("plan", planned)
            hook, self.cache_hook = self.cache_hook, CacheHook(None)
            try:
                for r in chunk:
                    super().generate_until([r], disable_tqdm=True)
            finally:
                self.cache_hook = hook
                self._lcx_generation_mode = None
            if self.lcx_fit_prefix_cache:  # prompts reuse each other's prefixes: hold the longest whole
                self.lcx_engine.fit_prefix_cache(max(len(row) for row, _ in planned))
            outs = self.lcx_engine.generate([row for row, _ in planned], [params for _, params in planned])
            self._lcx_generation_mode = ("replay", dict(enumerate(outs)))
            try:
                for r in chunk:
                    out.append(super(LcxLM, self).generate_until([r], disable_tqdm=True)[0])
                    bar.update(1)
            finally:
                self._lcx_generation_mode = None
        bar.close()
        return out

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        """HFLM's generation hook, run by `lcx.engine`: `context` `[B, T]` (left-padded; HFLM passes
        its `attention_mask`, 0 on padding) -> `[B, <= max_length]` ids, context then continuation,
        finished rows padded with the pad token (as HF `generate` returns)."""
        params = _sampling_params(generation_kwargs, max_length - context.shape[1], stop)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.lcx_engine.pad_id
        mask = generation_kwargs.get("attention_mask")
        rows = context.tolist() if mask is None else [
            [t for t, m in zip(row, keep) if m] for row, keep in zip(context.tolist(), mask.tolist())]
        mode = getattr(self, "_lcx_generation_mode", None)
        if mode is not None and mode[0] == "plan":  # (one request at a time: record it, answer nothing)
            mode[1].extend((row, params) for row in rows)
            return torch.cat((context.cpu(), torch.full((len(rows), 1), pad, dtype=context.dtype)), dim=1)
        if mode is not None:  # replay: the planned requests' order, one row each
            answers = mode[1]
            key = min(answers)
            outs = [answers.pop(key)]
            if list(outs[0].prompt_ids) != rows[0]:
                raise RuntimeError("lcx model: a replayed request's prompt differs from the planned one")
        else:
            outs = self.lcx_engine.generate(rows, params)
        width = max(len(o.token_ids) for o in outs)
        cont = torch.full((len(outs), width), pad, dtype=context.dtype)
        for b, o in enumerate(outs):
            cont[b, : len(o.token_ids)] = torch.tensor(o.token_ids, dtype=context.dtype)
        return torch.cat((context.cpu(), cont), dim=1).to(context.device)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, override_bs: int | None = None,
                              ) -> list[tuple[float, bool]]:
        """HFLM's scoring of `loglikelihood` and `loglikelihood_rolling`, without `[B, T, vocab]`
        logits: the decoder runs once per batch and the continuation's tokens are scored in chunks
        (`lcx.eval.loss`), so a 16k-token window of a 262k-vocabulary model needs 256 MiB-sized
        chunks instead of 17 GB. The same requests, order, truncation (left, to `max_length`),
        batching, one-token-continuation cache (`logits_cache`), cache hooks and answers
        `(sum of log p, all greedy)` as HFLM's (tests/eval/test_loss.py compares them)."""
        from lm_eval.models.utils import Collator
        from tqdm import tqdm

        from lcx.eval.loss import check_head, head_logits, hidden_states, token_logprobs

        def _collate(req):  # HFLM's order: longest first
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        re_ord = Collator(requests, sort_fn=_collate, group_by="contexts" if self.logits_cache else None,
                          group_fn=lambda req: req[-2] + req[-1][:-1])
        auto = self.batch_size == "auto"
        batch_size = (override_bs or 0) if auto else self.batch_size
        if auto and len(re_ord) > 0 and not override_bs:
            self.batch_sizes = {}
        batch_fn = self._batch_scheduler if auto and len(re_ord) > 0 and not override_bs else None
        model, sm_dtype = self.model, self.softmax_dtype
        check_head(model)
        res: list[tuple[float, bool]] = []
        pbar = tqdm(total=len(requests), disable=(disable_tqdm or (self.rank != 0)),
                    desc="Running loglikelihood requests")
        for chunk in re_ord.get_batched(n=batch_size, batch_fn=batch_fn):
            inps = []
            if (where := self._check_lengths()) is not None:  # HFLM's input: all but the last token
                from lcx.truncation import check_loglikelihood

                check_loglikelihood(chunk, self.max_length, input_drops_last=True,
                                    tasks=getattr(self, "lcx_tasks", None) or "(task not named)", **where)
            for _, context_enc, continuation_enc in chunk:
                if not context_enc or not continuation_enc or len(continuation_enc) > self.max_length:
                    raise ValueError(f"lcx model: loglikelihood request with {len(context_enc)} context and "
                                     f"{len(continuation_enc)} continuation tokens (max_length {self.max_length})")
                # HFLM's left truncation: the last max_length tokens of context + continuation[:-1]
                if len(context_enc) + len(continuation_enc) > self.max_length + 1:
                    log.warning("lcx model: context (%d) + continuation (%d) tokens exceed max_length %d: "
                                "the first %d tokens are dropped", len(context_enc), len(continuation_enc),
                                self.max_length, len(context_enc) + len(continuation_enc) - self.max_length - 1)
                inps.append((context_enc + continuation_enc)[-(self.max_length + 1):][:-1])
            width = max(len(x) for x in inps)
            batch = torch.zeros(len(inps), width, dtype=torch.long)  # right-padded
            for b, x in enumerate(inps):
                batch[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                                 enabled=self.mixed_precision_dtype is not None):
                batch = batch.to(self.device)
                with self.lcx_engine.forward_scope(batch):  # a windowed model as loaded: no [T, T] mask
                    hidden = hidden_states(model, batch)  # [B, width, H]
                for (request_str, ctx_tokens, cont_toks), inp, h in zip(chunk, inps, hidden):
                    n = len(cont_toks)
                    h_cont = h[len(inp) - n : len(inp)]  # [n, H]: the states that predict the continuation
                    # every continuation token but the last, chunked; the last position's whole
                    # distribution, which one-token-continuation cache hits are scored from
                    lp, greedy = token_logprobs(model, h_cont[:-1], torch.tensor(cont_toks[:-1], dtype=torch.long),
                                                softmax_dtype=sm_dtype)
                    last = torch.log_softmax(head_logits(model, h_cont[-1:]), dim=-1, dtype=sm_dtype)[0]  # [V]
                    for req_str, cont, _ in re_ord.get_cache(req_str=request_str, cxt_toks=ctx_tokens,
                                                             cont_toks=cont_toks, logits=last[None, None]):
                        # a hit of a group is a one-token continuation (lm-eval yields its last token)
                        cont = [int(cont)] if not isinstance(cont, (list, tuple)) else list(cont)
                        k = len(cont) - 1  # earlier tokens: the trailing k of this row's continuation
                        lps = torch.cat((lp[lp.numel() - k:].to(last.dtype), last[cont[-1]].reshape(1)))
                        answer = (float(lps.sum()),
                                  bool(greedy[greedy.numel() - k:].all()) and int(last.argmax()) == cont[-1])
                        res.append(answer)
                        if req_str is not None:
                            self.cache_hook.add_partial("loglikelihood", req_str, answer)
                        pbar.update(1)
        pbar.close()
        return re_ord.get_original(res)

    def get_model_info(self) -> dict:
        """What lm-eval records about the model: no hub lookups (HFLM asks the hub for a SHA)."""
        from lcx.models import resolve_source

        kind, path = resolve_source(self.pretrained)
        return {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "lcx_source": f"{kind}:{path}",
            "lcx_rope": self.lcx_spec.to_dict() if self.lcx_spec is not None else None,
            "lcx_attention": self.lcx_attention,
            "lcx_methods": self.lcx_config.to_dict(),
        }
