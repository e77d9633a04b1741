"""What Linux says of this process's memory (/proc): the batch-size search, `plan --measure` and the
benchmark scripts read it one way."""

from __future__ import annotations


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
