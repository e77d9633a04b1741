"""Whether a checkpoint is whole: its COMPLETE marker, each file's size and header, and checksums
of its files, recorded when it is saved and verified before it is resumed.

Sizes and headers catch a truncated file, not one overwritten in place: such a checkpoint resumed,
hit NaN, and was named "the last good checkpoint". Every file a save writes gets a CRC-32, kept in
trainer_state.json under `crc32`. A CRC is made for accidental damage (bit rot, a torn or misdirected
write): it catches every burst of up to 32 flipped bits and misses other damage with odds of 2^-32.
zlib's is the fastest hash in the standard library here, about 1.4 GB/s against blake2b's 0.35 and
sha256's 0.65, and faster than the write itself (BENCHMARKS.md).

Each rank hashes the files it wrote, right after writing them (read back from the page cache): the
per-rank files are named for their rank (DeepSpeed's partitions, the RNG states), DCP's shards are
hashed by the writer that wrote them (trainloop.parallel.dcp), and the main process hashes the rest when it
commits the folder. A rank leaves its checksums in PENDING; the commit gathers them.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
import zlib
from pathlib import Path

COMPLETE = "COMPLETE"  # written last: a folder without it is never loaded
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp_"  # a save being written, or a folder being removed
KEY = "crc32"  # trainer_state.json: {file: checksum}
PENDING = ".checksums"  # the ranks' records, until the commit gathers them
# files a rank writes for itself: DeepSpeed's [bf16_]zero_pp_rank_R_..., accelerate's random_states_R.pkl,
# the objective's objective_R.pt (trainloop.checkpoint.checkpointer)
RANK_FILE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_|^random_states_(\d+)\.pkl$|^objective_(\d+)\.pt$")
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
            if f.is_file() and (m := RANK_FILE.search(f.name)) and int(next(filter(None, m.groups()))) == rank]
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


def step_of(path: Path) -> int:
    return int(path.name.rpartition("_")[2])


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if (p / COMPLETE).is_file()), key=step_of)


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file is 8 bytes of header length, a JSON header, then the tensors' bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else size
        if 8 + header_len > size:
            return f"is truncated ({size} bytes: its header is cut off)"
        try:
            header = json.loads(f.read(header_len))
            end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError):
            return "has a corrupt safetensors header"
    if 8 + header_len + end != size:
        return f"is {size} bytes, but its header describes {8 + header_len + end} (truncated?)"
    return None


def torch_file_problem(path: Path) -> str | None:
    """torch.save writes a zip whose directory is at its end: a truncated one does not open."""
    with path.open("rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return None  # not torch's zip format (an older pickle): not checked here
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        return f"is truncated or corrupt ({err})"
    return None


def json_problem(path: Path) -> str | None:
    try:
        json.loads(path.read_text())
    except (ValueError, OSError) as err:
        return f"is not valid JSON ({err})"
    return None


FILE_CHECKS = {".safetensors": safetensors_problem, ".bin": torch_file_problem, ".pt": torch_file_problem,
               ".pkl": torch_file_problem, ".pth": torch_file_problem, ".json": json_problem}


def why_unloadable(path: Path) -> str | None:
    """Why a complete checkpoint would fail to load, naming the file; None if it is whole: sizes,
    headers and zip directories first, then every file's checksum (one read of the checkpoint)."""
    try:
        saved = read_state(path)
        saved["state"]["step"], saved["fingerprint"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{path / STATE_FILE} is unreadable ({type(err).__name__}: {err})"
    for name, size in saved.get("files", {}).items():  # recorded at save time (since issue 12)
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} is {file.stat().st_size} bytes, but {size} were saved (truncated?)"
    for file in sorted(path.rglob("*")):
        check = FILE_CHECKS.get(file.suffix)
        problem = check(file) if check and file.is_file() else None
        if problem:
            return f"{file} {problem}"
    return damaged(path, saved.get(KEY, {}))


def file_sizes(root: Path) -> dict:
    return {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}
