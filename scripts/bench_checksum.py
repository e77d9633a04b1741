"""What a checkpoint's checksums cost against writing it: `python scripts/bench_checksum.py [MiB]`.

Writes a model file (safetensors) and an optimizer file (torch.save) as accelerate's save_state does,
fsynced as trainloop's commit does, then hashes them with trainloop.checkpoint.integrity.checksum (read back
from the page cache, as right after a save) and, for comparison, with hashlib's blake2b and sha256.
Best of 3 each; MiB/s over both files.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainloop.checkpoint.integrity import checksum


def best_of(action, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def digest(path: Path, name: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, name).hexdigest()


def main(mib: int) -> None:
    n = mib * 2**20 // 4 // 3  # the model's floats; the optimizer holds two more of each
    model = {"weight": torch.randn(n)}
    optimizer = {"state": {0: {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}}}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        files = [Path(tmp) / "model.safetensors", Path(tmp) / "optimizer.bin"]

        def write():
            save_file(model, files[0])
            torch.save(optimizer, files[1])
            for file in files:
                with open(file, "rb") as f:
                    os.fsync(f.fileno())

        def hashed(make):
            def run():
                for file in files:
                    make(file)
            return run

        seconds = {"write + fsync": best_of(write)}
        size = sum(f.stat().st_size for f in files)
        seconds["crc32 (trainloop.checkpoint.integrity)"] = best_of(hashed(checksum))
        for name in ("blake2b", "sha256"):
            seconds[name] = best_of(hashed(lambda f, name=name: digest(f, name)))
    print(f"{size / 2**20:.0f} MiB in 2 files")
    for what, s in seconds.items():
        ratio = "" if what.startswith("write") else f"  {s / seconds['write + fsync']:.2f}x the write's time"
        print(f"{what:30s} {size / 2**20 / s:8.0f} MiB/s{ratio}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
