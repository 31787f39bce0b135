"""Memory available to the engine at start-up: what `lcx serve` sizes its default max_model_len
by (`lcx.serve.lengths`) and what caps the prefix cache's automatic bound (`EngineConfig`
`prefix_cache_bytes=None`)."""

from __future__ import annotations

import os
from typing import Any

MEMORY_FRACTION = 0.25  # of the memory available at start-up: one prompt's prefill; the auto cache bound


def available_memory(device: Any) -> int:
    """Bytes available on `device` now: the GPU's free memory, or the host's MemAvailable
    (/proc/meminfo; else the physical memory)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


__all__ = ["MEMORY_FRACTION", "available_memory"]
