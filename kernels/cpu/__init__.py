"""CPU C++ kernels of lcx (installed as `lcx.kernels.cpu`; the .cpp sources ship as package data).

- `relative_attention.cpp`: softmax attention over a paged cache with per-(query, key)
  relative rotations (`paged_relative_attention_cpu`): gather, relative rotation (skipped for
  identity rows) and masked softmax fused; the vLLM plugin's decode and prefill for LM-Infinite,
  StreamingLLM sinks and Self-Extend (keys cached after RoPE, only moved keys re-rotated) and on
  unrotated caches. The same extension holds `write_kv` (the plugin's cache write) and
  `rule_plan` (the decode plan's "cpp" backend, `lcx.methods.plan`: equal bit for bit to its
  numpy reference `step_plan_ref`; the vLLM plugin calls it fused with its block-table lookup).
- `causal_attention.cpp`: causal / sliding-window float32 attention of a row's newest queries
  (`causal_attention.causal_attention_cpu`), flash-style over blocks of 64 keys with AVX-512
  register tiles: the engine's prefill and mixed-step rows of a model as loaded
  (`lcx.hf.attention_call.native_rows`).

Compiled on first use by `torch.utils.cpp_extension.load` (cached); importing this package
compiles nothing.
"""

from .relative_attention import CPP_SOURCE, compact_index, load_extension, paged_relative_attention_cpu, unavailable

__all__ = ["CPP_SOURCE", "compact_index", "load_extension", "paged_relative_attention_cpu", "unavailable"]
