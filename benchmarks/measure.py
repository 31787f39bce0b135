"""Process-level memory measurement for benchmark scripts (Linux /proc; run one case per process).

`reset_peak()` resets the kernel's resident-set high-water mark (writing 5 to
/proc/self/clear_refs), so `status_bytes("VmHWM") - before` after a call is the peak resident
memory that call added.
"""

from __future__ import annotations

import re


def status_bytes(key: str) -> int:
    """A /proc/self/status field in bytes, e.g. "VmRSS" or "VmHWM"."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
