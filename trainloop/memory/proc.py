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


ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")  # the malloc libraries a process may have preloaded


def host_allocator() -> str:
    """The malloc this process's tensors on the host come from: one of ALLOCATORS where its library is mapped
    (LD_PRELOAD), else "glibc"; "" off Linux."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return ""
    return next((name for name in ALLOCATORS if f"lib{name}" in maps), "glibc")


def jemalloc_library() -> str | None:
    """jemalloc's shared library where a package installs it (Debian's libjemalloc2, Fedora's jemalloc, conda's),
    or None. Looked for by name, not through ldconfig or a compiler: every `python -m trainloop` asks."""
    import os
    import sysconfig

    folders = [f"/usr/lib/{sysconfig.get_config_var('MULTIARCH') or ''}", "/usr/lib64", "/usr/lib", "/usr/local/lib",
               "/usr/local/lib64"]
    if os.environ.get("CONDA_PREFIX"):
        folders.insert(0, os.path.join(os.environ["CONDA_PREFIX"], "lib"))
    return next((path for folder in folders for name in ("libjemalloc.so.2", "libjemalloc.so")
                 if os.path.exists(path := os.path.join(folder, name))), None)
