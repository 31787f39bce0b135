"""Keep the engine fed while the event loop is flooded.

The event loop thread and the engine's worker thread share the GIL. The engine gives it up at
every torch op and must win it back; while the loop is busy (a flood of refused bodies, of new
connections, of slow clients) each of those hand-overs waits, and a decode step that takes
30 ms alone took 100-600 ms under a loopback flood of hostile bodies (issue #34). `LoopPacer` is
a task on the loop that, while the engine has work, caps the loop thread's share of CPU time:
every `tick_s` it compares the CPU time the loop thread used (`time.thread_time`) with the wall
time passed, and if the loop used more than `share` of it, it blocks the loop in `time.sleep`
(which releases the GIL) for as long as it takes to bring the share back down, at most
`max_pause_s`. Work the loop did not get to waits in the kernel (connections in the accept
queue, bytes in socket buffers) where it costs nothing. While the engine is idle the pacer does
nothing and the loop runs at full speed. It works with any event loop (asyncio's, uvloop).

With the engine in its own process (`lcx serve`'s default, `lcx.serve.engine_process`) the loop
no longer shares a GIL with the engine's torch ops, only with the reader thread that hands each
step's events to the loop (once per step), but it still shares the machine's cores with the
engine process: the pacer keeps a flood from taking the engine's CPU time. `engine_busy` is then
`EngineProcess.has_work` (requests submitted and not finished).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_SHARE = 0.3
TICK_S = 0.01
MAX_PAUSE_S = 0.02


class LoopPacer:
    def __init__(self, engine_busy: Callable[[], bool], *, share: float = DEFAULT_SHARE, tick_s: float = TICK_S,
                 max_pause_s: float = MAX_PAUSE_S):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.engine_busy, self.share, self.tick_s, self.max_pause_s = engine_busy, share, tick_s, max_pause_s
        self.paused_s = 0.0  # total time the loop was held back (for /stats)
        self.pauses = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.share < 1 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lcx-loop-pacer")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(self.tick_s)
            now, now_cpu = time.perf_counter(), time.thread_time()
            if not self.engine_busy():
                wall, cpu = now, now_cpu
                continue
            pause = min(self.max_pause_s, (now_cpu - cpu) / self.share - (now - wall))
            if pause > 0:
                time.sleep(pause)  # noqa: ASYNC251 - blocks the loop on purpose: the GIL goes to the engine
                self.paused_s += pause
                self.pauses += 1
            if now - wall > 4 * self.tick_s:  # judge the share over the last few ticks only
                wall, cpu = time.perf_counter() - self.tick_s, time.thread_time()
            # else keep accumulating: short ticks are too noisy to judge alone

    def to_dict(self) -> dict[str, float | int]:
        return {"share": self.share, "paused_s": round(self.paused_s, 3), "pauses": self.pauses}
