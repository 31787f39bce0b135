"""A small native inference engine: batched prefill + decode with a KV cache over an HF decoder of
any supported family (`lcx.hf.FAMILIES`), with lcx methods (RoPE specs; `lcx.methods` attention
methods: LM-Infinite, sliding window, StreamingLLM sinks, Self-Extend, SWAT) chosen at start-up.

    engine = Engine.from_pretrained("tiny-5m", EngineConfig(methods={"rope": {"rope_type": "yarn", "factor": 4}}))
    outs = engine.generate([engine.encode("ROMEO:"), engine.encode("JULIET:")],
                           SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=1))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

`generate` runs a list of requests to completion in one batch. The server (`lcx.serve`) drives
the same engine one `step()` at a time (continuous batching): `add_request` queues a request,
every `step` admits waiting requests (one batched prefill), runs one decode step for the requests
already running, and returns what each request produced (`StepEvent`s). Where the lean forward
runs the model (Llama, Mistral, Qwen2, Qwen3 decoders on the fast path) a step that has both runs
them as one forward, one token matrix through the weights as vLLM's step
(`EngineConfig.mixed_step`, `lcx.hf.lean_decode.MixedPrefill`); its prefill work is then
scheduled before the decode, so a slot freed in the step is taken in the next.

Batch layout. New requests are prefilled together, left-padded among themselves to one
HF `DynamicCache` (`mask [b, T]` marks real tokens, HF's 2D attention mask; attention methods
get per-row key positions instead, `lcx_key_positions`). A *position* is a token's index in its
own request (prompt token 0 is at position 0), passed as `position_ids`; it is what RoPE
rotates with. After the prefill the rows' keys and values move into the running batch's cache,
`lcx.engine.kv.KVStore` (its docstring states the layout once): per row, slots holding keys
rotated once at their positions (unpatched models: as HF rotated them), a ring of the method's
window for bounded methods, so a decode step writes each row's new key into its own slot and
runs one attention per layer for the whole batch, never copying or re-rotating the cache.
Each layer is bounded by what it runs (`lcx.engine.kv.KVLayout`): on a hybrid local/global
model (Gemma 3) the sliding layers hold a ring of their own window on their own RoPE base,
even for the model as loaded, and the global layers the method's window (or every key), so a
bounded method on the global layers makes the whole cache constant (`Engine.layer_cache_lens`,
`Engine.layer_kv_cache_bytes`).
Padding is exact: empty slots get zero weight, so a request's tokens and logprobs do not depend
on what it is batched with (up to float rounding of differently shaped matmuls; in float64
batched == unbatched token for token).

Prefill continuing from held KV, prefix caching (`lcx.engine.prefix` states the rules once). A
prompt may be prefilled in several calls, each continuing from the KV its request already holds
(chunked prefill), and a new request reuses the KV of the longest prefix of its prompt that an
earlier prompt left in the prefix cache (blocks of `prefix_block_size` tokens under a hash chained
over the tokens before them and the method config; LRU within `prefix_cache_bytes`; on by
default, `EngineConfig.prefix_caching`). Both are exact (greedy tokens and logprobs equal a
whole-prompt prefill; tests/engine/test_prefix_cache.py runs every method and RoPE type) and are
refused where a prefix's keys depend on what follows (`Engine.prefix_cache_refusal`:
length-dependent RoPE, `AttentionMethod.call_dependence`). Bounded methods hold only the keys they
can still see between chunks (LM-Infinite: G + L - 1 per layer). A model as loaded (no attention
method) continues on lcx's flash backend per row (`lcx.hf.attention_patch.loaded_rows`), so the
tokens after a hit cost what they cost in a whole prompt; one with sliding-window layers that the
engine leaves as loaded (a hybrid such as Gemma 3 under dynamic NTK, Mistral) prefills every
prompt that way (`windowed_rows_scope`: each layer its own window, no [T, T] mask). `EngineStats` counts the hits
(`prefix_cache_hit_rate`: reused / looked-up prompt tokens) and `prompt_tokens_computed`. A
request that shares an uncached block with one admitted in the same step waits one step and
reuses it (a burst with one system prompt computes it once), and `generate` submits the prompt
sharing most with the others first (a passkey sweep's deepest needle), outputs in the caller's
order.

Fair service (`max_num_batched_tokens`, a token budget per step; `lcx serve` sets one). Every step
decodes one token for every running request (decode is never starved by a prefill), then
spends what is left of the budget on prompts: a block for the oldest partly prefilled prompt
(it always progresses), then shortest remaining prompt first, the rest back to the oldest. Requests
of one group (the n samples of one API call, `add_request(group=)`) hold at most
max_batch - max(1, max_batch // 8) batch slots, and the group holding fewest slots is admitted
first. The bound: a short request (prompt within the budget left after the decode rows) arriving
beside a heavy neighbour (a 16k-token prompt being prefilled, or n = 256 samples) gets its first
token in the step after it arrives and a token in every step after that, each step running at
most budget + one block of tokens. Stated multiple: its latency stays within 10x its solo
latency (tests/engine/test_fair_scheduler.py, slow tier: budget 256, tiny model, medians of
interleaved runs on a busy 2-core machine measured 1.5x beside n = 256 samples and 3.5-7.5x
beside a 16k-token prompt; a step's cost also grows with the keys the chunk attends to, which
the token budget does not bound). Without a budget a short request arriving during a long
prompt's prefill waits for all of it. Without a budget (the default of `EngineConfig`,
`generate`) every admitted prompt is prefilled whole in the step that admits it.

Sampling, in vLLM's order. The logits are first adjusted (only for a request that asks):
`repetition_penalty` (tokens of the prompt or the output: a positive logit divided by it, a
negative one multiplied), `frequency_penalty` / `presence_penalty` (minus the penalty times the
token's count in the output / once if it occurs), and while fewer than `min_tokens` tokens are out,
the stop tokens (EOS unless `ignore_eos`, `stop_token_ids`) are masked and stop strings not checked.
Then `temperature == 0` is greedy (argmax). Otherwise softmax(logits / T), restricted to the tokens
with probability >= `min_p` x the top token's, then to the `top_k` most likely, then to the
smallest set whose (renormalised) probability reaches `top_p`, sampled with the request's own
`torch.Generator` (seeded by `seed`), so a seeded request gives the same tokens in any batch. With
none of these options set, sampling is exactly softmax(logits / T) + top-p as before they existed.
Logprobs (generated and prompt) are of the model's raw distribution, log_softmax(logits), before
penalties, temperature and truncation, as in vLLM.

Length-dependent RoPE types (dynamic NTK, longrope) pick their basis per forward from the
largest position in it (`lcx.hf.rope_patch`, as transformers): in a batch that is the longest row's, so
for them a request's output depends on what it is batched with (as with HF batched `generate`);
run with `max_batch=1` for per-request semantics. Static types have no such effect.

Limits: `max_model_len` bounds prompt + max_tokens; a request over it is rejected with
`ValueError` (never truncated). The methods are one `lcx.MethodConfig` (`EngineConfig.methods`),
applied at start-up by `MethodConfig.apply` (RoPE, then attention: the same route as
`lcx.patch`); its `context_len` is the default `max_model_len`. Attention methods (`"attention": {"type": "lm_infinite", "n_global": 16,
"n_local": 1024}`, `sliding_window`, `sinks`, `self_extend`; `lcx.methods`) patch the model's
attention for prefill; decoding follows the method's `decode_rule` over the cache of rotated
keys (`lcx.engine.kv`), which holds window + first keys per row for a bounded method however
long the request runs (LM-Infinite: G + L slots). Methods without a rule (SWAT), a RoPE basis
that changes with the length (dynamic NTK, longrope) together with an attention method, or an
explicit `decode_backend` decode on the general path: unrotated keys, each row's visible keys
gathered per step for the method's own `attend` (`lcx_key_positions`, `lcx.hf.attention_patch`).
Tokens equal unbatched decoding with a `BoundedKVCache` (or a full cache, for unbounded methods)
in float64 (tests/engine/test_engine_attention.py). A model trained with an attention method
(SWAT) records it in its config (`lcx.hf.recorded`); without an `attention` entry the engine
takes that method (`lcx.hf.recorded.recorded_method`; `Engine.methods` then names it) and bounds the cache from its `cache_window` the same
way, without patching (the model already runs it).

Package layout: `params` (SamplingParams, EngineConfig, limits), `prefix` (held KV of a
row being prefilled, the prefix cache, when reuse is refused),
`kv` (the running batch's KV cache and the decode step), `sampling` (penalties, greedy,
temperature/min_p/top_k/top_p, logprobs), `detok` (token bytes/strings, stop strings, the text
an unfinished request may hand out), `outputs` (TokenLogprob, StepEvent, RequestOutput,
EngineStats), `batch` (a prefill's cache as an HF cache), split as vLLM's v1 engine: `scheduler` (the
queues, admission, fairness, chunked prefill under the token budget, prefix-cache lookups; no
tensors), `runner` (the model runner: the forwards with the method's hooks through
`lcx.hf.engine_hook`, the bounded KV store `kv` and its decode step `decode_step`; no request
history) and `core` (the Engine: wires the two, owns request state, samples, stop conditions), `reference` (`greedy_decode_ref`: the one-token-per-forward
greedy loop over a caller's cache that the engine is checked against, and that decodes where the
engine's cache cannot go: HF `Cache` objects, an edited `PositionedKVCache`). Import from `lcx.engine`.
"""

from .core import Engine
from .kv import CacheLayout, DecodeStep, KVLayout, KVStore, ModelKV, ModelStep
from .outputs import EngineStats, RequestOutput, StepEvent, TokenLogprob
from .params import FINISH_REASONS, INT64_MAX, INT64_MIN, MAX_LOGPROBS, ContextLengthError, EngineConfig, SamplingParams

__all__ = [
    "CacheLayout",
    "DecodeStep",
    "FINISH_REASONS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_LOGPROBS",
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "KVLayout",
    "KVStore",
    "ModelKV",
    "ModelStep",
    "RequestOutput",
    "SamplingParams",
    "StepEvent",
    "TokenLogprob",
]
