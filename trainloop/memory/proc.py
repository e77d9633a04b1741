"""What Linux says of this process's memory (/proc), read one way by the batch-size search, `plan --measure`
and the benchmark scripts, and glibc's mmap threshold, which the measurements set."""

from __future__ import annotations

import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def status_bytes(key: str) -> int:
    """A byte count of /proc/self/status: VmRSS (resident now), VmHWM (its peak), VmData, RssFile (the
    pages of mapped files: the libraries' code and data). Raises OSError off Linux, KeyError if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"no {key} in /proc/self/status")


def mem_available() -> int | None:
    """The memory the system can still give (MemAvailable of /proc/meminfo); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Start the peak resident set (VmHWM) again from the current one; False where the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mmap_threshold(nbytes: int, trim: bool = False) -> bool:
    """glibc gives every allocation of `nbytes` or more its own mapping, unmapped when it is freed, and stops
    moving that threshold itself; `trim`: and hands back to the system what its heap holds free now. False
    where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        if not libc.mallopt(M_MMAP_THRESHOLD, nbytes):
            return False
        if trim:
            libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
