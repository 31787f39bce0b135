"""How many CPU threads torch uses in lcx's commands: `--threads N`, `LCX_THREADS=N`, or `auto`.

Why not torch's default (one thread per core): on a small shared machine the cores are rarely
all free. With 2 cores and another busy process, torch's 2 OpenMP threads wait on each other
at every op and a decode step runs several times slower than on 1 thread (issue #16 measured
24 vs 105 tok/s for `lcx serve` on 2 busy cores; `lcx bench threads` -> results/threads_cpu.json
has this machine's numbers). On an idle machine with many cores, more threads win at long
prefills. No fixed number is right everywhere, so `auto` (the default of every lcx command)
measures: it times a sustained decode-shaped workload (~40 ms of MLP matmuls of a 576-wide
layer, SmolLM2-135M's width, on 16 rows) with 1 thread and with every available core,
alternating, 3 rounds, and keeps the faster (the fewer threads unless the larger count is >= 10%
faster). It costs ~0.3-0.8 s,
once per process, and reflects the load at start-up: a long-lived server started on an idle
machine that later gets busy keeps its choice (give `--threads 1` for a machine shared with
other jobs).

    threads = resolve_threads(args.threads)          # an int >= 1, applied to torch, and logged
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

log = logging.getLogger("lcx.threads")

AUTO = "auto"
ENV_VAR = "LCX_THREADS"
# the larger thread count must be at least this much faster to be chosen
MARGIN = 0.10

_decision: dict[str, Any] | None = None  # the auto decision of this process (measured once)
_resolved = False  # whether `resolve_threads` set this process's threads (then `contention` stays quiet)
_warned = False


def available_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def parse_threads(text: str | int | None) -> int | str | None:
    """`--threads` values: a positive integer or `auto` (None: not given)."""
    if text is None or isinstance(text, int) and not isinstance(text, bool):
        if isinstance(text, int) and text < 1:
            raise ValueError(f"threads must be >= 1 or 'auto', got {text}")
        return text
    t = str(text).strip().lower()
    if t == AUTO:
        return AUTO
    try:
        n = int(t)
    except ValueError:
        raise ValueError(f"threads must be a positive integer or 'auto', got {text!r}") from None
    if n < 1:
        raise ValueError(f"threads must be >= 1 or 'auto', got {text!r}")
    return n


def _argparse_threads(text: str) -> int | str:
    try:
        return parse_threads(text)  # type: ignore[return-value]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_threads_argument(parser: argparse.ArgumentParser, default: int | str = AUTO) -> None:
    """`--threads N|auto` with lcx's help text (the same on every command)."""
    parser.add_argument(
        "--threads", type=_argparse_threads, default=default, metavar="N|auto",
        help=f"torch CPU threads (default: {default}; `auto` times 1 thread against every core at start-up "
             f"and keeps the faster, which on a busy 2-core machine is 1; {ENV_VAR} overrides `auto`)")


def _workload(reps: int) -> float:
    """Seconds for `reps` back-to-back MLP matmuls of a 16-row batch ([16, 576] x [576, 1536] and
    back): sustained (~40 ms at reps=100), because a busy neighbour core shows only in sustained
    work -- a few-millisecond burst on 2 threads still wins on a loaded 2-core machine (measured:
    4 ms bursts 1.7x faster on 2 threads while the engine ran 8x slower on them)."""
    import torch

    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(576, 1536, generator=g)
    w2 = torch.randn(1536, 576, generator=g)
    x = torch.randn(16, 576, generator=g)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.relu(x @ w1) @ w2
    return time.perf_counter() - t0


def measure(candidates: tuple[int, ...], rounds: int = 3, reps: int = 100) -> dict[int, float]:
    """Median seconds of the workload per thread count, the counts interleaved round by round
    (so a load that changes during the measurement affects all of them alike)."""
    import torch

    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in candidates}
    try:
        for n in candidates:  # warm-up: thread pools, allocator
            torch.set_num_threads(n)
            _workload(5)
        for _ in range(rounds):
            for n in candidates:
                torch.set_num_threads(n)
                times[n].append(_workload(reps))
    finally:
        torch.set_num_threads(before)
    return {n: statistics.median(v) for n, v in times.items()}


def choose(timings: dict[int, float], margin: float = MARGIN) -> int:
    """The fewest threads unless a larger count is at least `margin` faster."""
    best = min(timings)
    for n in sorted(timings):
        if timings[n] < timings[best] * (1 - margin):
            best = n
    return best


def auto_threads(refresh: bool = False) -> dict[str, Any]:
    """The measured choice for this process: {"threads", "cores", "timings_s", "source"};
    measured once, or again with `refresh=True` (e.g. under a different load)."""
    global _decision
    if _decision is None or refresh:
        cores = available_cores()
        if cores == 1:
            _decision = {"threads": 1, "cores": 1, "timings_s": {}, "source": "auto (1 core)"}
        else:
            t = measure((1, cores))
            _decision = {"threads": choose(t), "cores": cores,
                         "timings_s": {str(k): round(v, 5) for k, v in t.items()}, "source": "auto (measured)"}
    return dict(_decision)


def resolve_threads(threads: int | str | None = AUTO, *, apply: bool = True) -> int:
    """The thread count to use: an explicit integer as given; `auto`/None -> `LCX_THREADS` if set,
    else `auto_threads()`. Applied to torch (`torch.set_num_threads`) unless `apply=False`."""
    global _resolved
    threads = parse_threads(threads)
    source = "--threads"
    if threads is None or threads == AUTO:
        env = os.environ.get(ENV_VAR)
        if env:
            try:
                threads = parse_threads(env)
            except ValueError as e:
                raise ValueError(f"{ENV_VAR}: {e}") from None
            source = ENV_VAR
        if threads is None or threads == AUTO:
            d = auto_threads()
            threads, source = d["threads"], f"{d['source']}: {d['timings_s']} s per round on {d['cores']} cores"
    if apply:
        import torch

        torch.set_num_threads(int(threads))
        _resolved = True
    log.info("torch threads: %d (%s)", threads, source)
    return int(threads)


def contention(threads: int, cores: int | None = None, load: float | None = None) -> str | None:
    """Why `threads` torch threads may run this process several times slower, or None: more than
    one thread, and fewer cores free than threads (`cores` available, less the 1-minute load
    average `load` of the machine, rounded), so the threads wait on each other at every op (the
    module docstring). Arguments default to this process's and machine's."""
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
    if threads <= 1 or threads <= cores - round(load):
        return None
    return (f"torch runs {threads} threads on {cores} cores while the load average is {load:.1f}: threads that "
            "wait on each other can make lcx's engine several times slower (docs/serving.md, --threads); call "
            "lcx.threads.resolve_threads('auto') or torch.set_num_threads(1) first")


def warn_contention() -> None:
    """Log `contention`'s warning once per process, unless lcx chose the threads (`resolve_threads`,
    as every lcx command does) or `LCX_THREADS` is set: for a library user who builds an engine
    with torch's default, one thread per core (`lcx.engine.Engine` calls it on the CPU)."""
    global _warned
    if _warned or _resolved or os.environ.get(ENV_VAR):
        return
    import torch

    why = contention(torch.get_num_threads())
    if why is not None:
        _warned = True
        log.warning(why)


__all__ = ["AUTO", "ENV_VAR", "add_threads_argument", "auto_threads", "available_cores", "choose", "contention",
           "measure", "parse_threads", "resolve_threads", "warn_contention"]
