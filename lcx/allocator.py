"""Freed memory kept for reuse in lcx's compute processes: `reuse_freed_memory()` (glibc malloc).

Why. torch's CPU tensors come from the C library's malloc. glibc serves every block above its
mmap threshold (dynamic, from 128 KiB up to at most 32 MiB) with a fresh `mmap` and gives it back
with `munmap` when it is freed, and it trims the top of its heap back to the system as soon as
128 KiB there are free. A long prefill allocates and frees the same large activations at every
layer (a [T, width] hidden state, the MLP's [T, 4·width], attention's per-block scores), so every
page of them is faulted in and zeroed by the kernel again and again: measured 2026-12-02, one
thread, greedy through `lcx.engine` (`lcx bench allocator` records it), Gemma-3-270m at 8k spent 19% of its CPU time in
the kernel (3.1 M page faults for one prompt), a running 48k RULER sweep 18%, SmolLM2-135M 6-7%.
PyTorch's CPU tuning guides answer this with jemalloc or tcmalloc; neither ships with this
environment, and glibc can do the same with two settings:

- `M_MMAP_MAX = 0`: no block is served by mmap; large blocks come from the heap like small ones;
- `M_TRIM_THRESHOLD` = 2 GiB (mallopt's largest): freed memory stays in the heap for the next
  block instead of going back to the system, unless 2 GiB at the heap's top are free at once.

These are the settings glibc also reads at start-up from `MALLOC_MMAP_MAX_=0` and
`MALLOC_TRIM_THRESHOLD_=...` (`ENV`: export them to give a process whose code does not call this,
e.g. an older lcx, the same settings); `mallopt(3)` sets them in a running process for every later allocation.

What it costs: the process keeps its high-water mark of memory until it exits (the heap is not
given back), and a block of a new size may not fit the holes older ones left (measured above:
peak RSS +2-6%). It changes no numbers: which address a tensor gets is not something any result
depends on (the same greedy tokens and logits, measured; tests/test_allocator.py checks the
faults it saves). lcx applies it in the processes that run models for a whole command: `lcx
report` and its workers, `lcx eval ppl`, `lcx demo`, `lcx train`, the `lcx` lm-eval model and the engine
process of `lcx serve`. Not in the server's own process (a storm of 30 MB bodies there would leave
its memory at the storm's peak; `--no-engine-process` keeps glibc's defaults), not in `lcx bench`
(the committed records were measured without it; `lcx bench allocator` measures both; `lcx bench
prefix --allocator reuse`, its default since 2026-12-07, sets it in both engines' processes), not on
import (a library does not change its host's allocator).

`LCX_MALLOC=system` leaves glibc's defaults. On a C library other than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from typing import Any

log = logging.getLogger("lcx.allocator")

ENV_VAR = "LCX_MALLOC"  # "reuse" (default) or "system"
M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: its largest, 2 GiB
ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}  # the same, for a new process

_state: dict[str, Any] | None = None


def reuse_freed_memory() -> dict[str, Any]:
    """Keep freed memory in this process's heap for reuse (module docstring). Idempotent; returns
    what was done: {"allocator": "reuse" | "system", "reason": ...}."""
    global _state
    if _state is not None:
        return dict(_state)
    choice = os.environ.get(ENV_VAR, "reuse").strip().lower() or "reuse"
    if choice not in ("reuse", "system"):
        raise ValueError(f"{ENV_VAR} must be 'reuse' or 'system', got {os.environ[ENV_VAR]!r}")
    if choice == "system":
        _state = {"allocator": "system", "reason": f"{ENV_VAR}=system"}
    elif platform.libc_ver()[0] != "glibc":
        _state = {"allocator": "system", "reason": "not glibc"}
    else:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        _state = ({"allocator": "reuse", "reason": f"mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD={TRIM_THRESHOLD})"}
                  if ok else {"allocator": "system", "reason": "mallopt refused"})
    log.debug("allocator: %s (%s)", _state["allocator"], _state["reason"])
    return dict(_state)


def allocator_state() -> dict[str, Any]:
    """What `reuse_freed_memory` did in this process (recorded beside results: `lcx.data.io.environment`)."""
    return dict(_state) if _state is not None else {"allocator": "system", "reason": "not set in this process"}


__all__ = ["ENV", "ENV_VAR", "allocator_state", "reuse_freed_memory"]
