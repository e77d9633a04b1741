"""Checksums of a checkpoint's files: recorded when it is saved, verified before it is resumed.

Sizes and headers catch a truncated file, not one overwritten in place: such a checkpoint resumed,
hit NaN, and was named "the last good checkpoint". Every file a save writes gets a CRC-32, kept in
trainer_state.json under `crc32`. A CRC is made for accidental damage (bit rot, a torn or misdirected
write): it catches every burst of up to 32 flipped bits and misses other damage with odds of 2^-32.
zlib's is the fastest hash in the standard library here, about 1.4 GB/s against blake2b's 0.35 and
sha256's 0.65, and faster than the write itself (BENCHMARKS.md).

Each rank hashes the files it wrote, right after writing them (read back from the page cache): the
per-rank files are named for their rank (DeepSpeed's partitions, the RNG states), DCP's shards are
hashed by the writer that wrote them (trainloop.dcp), and the main process hashes the rest when it
commits the folder. A rank leaves its checksums in PENDING; the commit gathers them.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

KEY = "crc32"  # trainer_state.json: {file: checksum}
PENDING = ".checksums"  # the ranks' records, until the commit gathers them
# files a rank writes for itself: DeepSpeed's [bf16_]zero_pp_rank_R_..., accelerate's random_states_R.pkl
RANK_FILE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_|^random_states_(\d+)\.pkl$")
CHUNK = 1 << 22


def checksum(path: Path) -> str:
    crc, buffer = 0, bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def record(directory: Path, names: list[str], who: str) -> None:
    """Hash the files `names` (relative to the checkpoint folder) for the commit to gather."""
    sums = {name: checksum(directory / name) for name in names}
    (directory / PENDING).mkdir(exist_ok=True)
    (directory / PENDING / f"{who}.json").write_text(json.dumps(sums))


def record_rank_files(directory: Path, rank: int) -> None:
    """After a synchronous save: the files named for this rank."""
    mine = [str(f.relative_to(directory)) for f in sorted(directory.rglob("*"))
            if f.is_file() and (m := RANK_FILE.search(f.name)) and int(m.group(1) or m.group(2)) == rank]
    if mine:
        record(directory, mine, f"rank_{rank}")


def gather(directory: Path) -> dict[str, str]:
    """Main process, at the commit: the ranks' checksums, and those of the files none of them hashed."""
    sums = {}
    for part in sorted((directory / PENDING).glob("*.json")):
        sums.update(json.loads(part.read_text()))
    shutil.rmtree(directory / PENDING, ignore_errors=True)
    for file in sorted(directory.rglob("*")):
        name = str(file.relative_to(directory))
        if file.is_file() and name not in sums:
            sums[name] = checksum(file)
    return dict(sorted(sums.items()))


def damaged(path: Path, sums: dict[str, str]) -> str | None:
    """The first file of checkpoint `path` whose content differs from what was saved, said in a line."""
    for name, saved in sums.items():
        now = checksum(path / name)
        if now != saved:
            return (f"{path / name} does not match the checksum saved with it (crc32 {saved}, now {now}): "
                    "it changed on disk after the save")
    return None
