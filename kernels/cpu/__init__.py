"""CPU C++ kernels of lcx (installed as `lcx.kernels.cpu`; the .cpp sources ship as package data).

- `relative_attention.cpp`: softmax attention over a paged cache of unrotated keys with
  per-(query, key) relative positions (`paged_relative_attention_cpu`): gather, relative
  rotation and masked softmax fused; the vLLM plugin's decode and prefill for LM-Infinite,
  StreamingLLM sinks, sliding window and Self-Extend.

Compiled on first use by `torch.utils.cpp_extension.load` (cached); importing this package
compiles nothing.
"""

from .relative_attention import CPP_SOURCE, load_extension, paged_relative_attention_cpu, unavailable

__all__ = ["CPP_SOURCE", "load_extension", "paged_relative_attention_cpu", "unavailable"]
