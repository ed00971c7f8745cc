"""Peak-RSS probes shared by the memory benchmarks (bench/loss_memory.py, bench/step.py); not a benchmark itself.

Linux only: /proc/self/status gives VmRSS (now) and VmHWM (peak); writing 5 to /proc/self/clear_refs resets the
peak to the current RSS, so a measurement can count only what its own step allocates.
"""

from __future__ import annotations

import re


def rss_kib(field: str) -> int:
    """A /proc/self/status memory field in KiB ("VmRSS", "VmHWM")."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def reset_peak() -> bool:
    """Reset VmHWM (peak RSS) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
