"""Token documents into training blocks, the same way for data tokenized by the run and for shards
(PlannedBlocks, a TrainingSet of trainloop.data.sets).

A corpus is a sequence of documents (rows), stored end to end in one or more parts: token ids, the
offsets where each document starts, and, for chat and prompt/completion data, which tokens are
targets. Whole documents are held out for validation; each document is fitted to data.seq_len
(data.overlong); the pieces are planned into blocks (data.packing). The plan is computed from the
document lengths (and, for masked data, where the targets are), never from a copy of the tokens:
O(documents) memory. A block's tokens are read from the parts when it is asked for.
"""

from __future__ import annotations

import heapq
import logging
import math
import mmap
from pathlib import Path

import numpy as np
import torch

from trainloop.data.sets import TrainingSet
from trainloop.data.tokenizer import IGNORE

log = logging.getLogger("trainloop")


def memory_map(path: Path) -> tuple[np.ndarray, mmap.mmap]:
    """A .npy file as a read-only array over a memory map of it, and the map."""
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(mapping, dtype=dtype, count=math.prod(shape), offset=f.tell()), mapping


class Part:
    """One stretch of documents: ids, offsets (documents + 1, from 0) and the target mask or None.

    A part read from a shard folder opens its files as memory maps on first use, and again in
    each DataLoader worker: pickling it sends the folder's path, never the tokens.
    """

    def __init__(self, ids=None, offsets=None, mask=None, folder: str | None = None, masked: bool = False):
        self.folder, self.masked = folder, masked if folder else mask is not None
        self._arrays = None if folder else (ids, offsets, mask)
        self._maps: list[mmap.mmap] = []

    @property
    def arrays(self):
        if self._arrays is None:
            names = ["ids.npy", "offsets.npy"] + (["mask.npy"] if self.masked else [])
            arrays, self._maps = zip(*(memory_map(Path(self.folder) / name) for name in names))
            self._arrays = (*arrays, None) if not self.masked else arrays
        return self._arrays

    def release(self) -> None:
        """Unmap the pages reads have mapped (they stay in the page cache): the kernel maps a read's
        neighbourhood too, which over random block reads grew the resident set ~0.5 MB a block."""
        for mapping in self._maps:
            mapping.madvise(mmap.MADV_DONTNEED)

    def __getstate__(self):
        return {**self.__dict__, "_arrays": None, "_maps": []} if self.folder else self.__dict__


class Documents:
    """The documents of a corpus, numbered 0.. across its parts."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self.lengths = np.concatenate([np.diff(np.asarray(p.arrays[1], dtype=np.int64)) for p in parts])
        self.first = np.cumsum([0] + [len(p.arrays[1]) - 1 for p in parts])  # first document of each part
        for part in parts:
            part.release()
        self.masked = parts[0].masked

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, doc: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Tokens [start, end) of a document: ids (int64) and which are targets (None: all)."""
        p = int(np.searchsorted(self.first, doc, side="right")) - 1
        ids, offsets, mask = self.parts[p].arrays
        at = int(offsets[doc - self.first[p]])
        piece = (np.array(ids[at + start:at + end], dtype=np.int64),
                 None if mask is None else np.array(mask[at + start:at + end], dtype=bool))
        self.parts[p].release()
        return piece

    def has_target(self, doc: int, start: int, end: int) -> bool:
        if not self.masked:
            return end > start
        return bool(self.read(doc, start, end)[1].any())

    def targets(self, doc: int, start: int, end: int) -> int:
        """How many of tokens [start, end) of a document are targets."""
        if not self.masked:
            return max(end - start, 0)
        return int(np.count_nonzero(self.read(doc, start, end)[1]))

    def all_targets(self) -> int:
        """The target tokens of every document, less each one's first (nothing before it predicts it)."""
        if not self.masked:
            return int(np.clip(self.lengths - 1, 0, None).sum())
        total = 0
        for part in self.parts:
            _, offsets, mask = part.arrays
            offsets, mask = np.asarray(offsets, dtype=np.int64), np.asarray(mask, dtype=bool)
            firsts = offsets[:-1][offsets[1:] > offsets[:-1]]
            total += int(np.count_nonzero(mask)) - int(np.count_nonzero(mask[firsts]))
            part.release()
        return total


def token_batches(tokens, batch_size: int = 10_000):
    """A tokenized `datasets.Dataset` (input_ids, labels if some tokens are not targets) in batches:
    (ids, lengths, target mask or None), read from its Arrow columns without a Python list."""
    for table in tokens.with_format("arrow").iter(batch_size=batch_size):
        ids = table["input_ids"].combine_chunks()
        lengths = np.diff(ids.offsets.to_numpy()).astype(np.int64)
        labels = table["labels"].combine_chunks().flatten().to_numpy() if "labels" in table.column_names else None
        yield ids.flatten().to_numpy(), lengths, None if labels is None else labels != IGNORE


def part_from_batches(batches, masked: bool, dtype=np.int64) -> Part:
    """One in-memory part from token_batches: what the run tokenized, or one shard being written."""
    batches = list(batches)
    ids = np.concatenate([b[0] for b in batches]).astype(dtype) if batches else np.zeros(0, dtype)
    lengths = np.concatenate([b[1] for b in batches]) if batches else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = (np.concatenate([b[2] for b in batches]) if batches else np.zeros(0, bool)) if masked else None
    return Part(ids, offsets, mask)


def split_documents(count: int, fraction: float, seed: int) -> np.ndarray:
    """The documents held out for validation: ceil(count x fraction) of them (at least 1, at most
    count - 1), drawn from the seed alone; sorted. Whole documents, so no text is in both splits."""
    from trainloop.errors import ConfigError

    if count < 2:
        raise ConfigError(f"the data holds {count} document(s): too little to train and validate; add data")
    held_out = min(max(math.ceil(count * fraction), 1), count - 1)
    return np.sort(np.random.default_rng(seed).permutation(count)[:held_out])


def fit_pieces(cfg, documents: Documents) -> tuple[np.ndarray, np.ndarray]:
    """Each document made to fit data.seq_len as data.overlong says: (full, pieces).

    full: rows (document, count) of documents whose first `count` seq_len-token pieces fill a block
    each (overlong=split of text data: kept as a count, so the plan stays O(documents) however long
    the documents are); pieces: the other pieces, rows (document, start, end). A piece's first
    label is never a target (in a packed block the token before it is another piece's), so a piece
    whose other tokens are no targets is dropped. Counted in the log.
    """
    from trainloop.errors import ConfigError

    seq_len, lengths = cfg.seq_len, documents.lengths
    docs = np.arange(len(lengths))
    overlong = lengths > seq_len
    counts = {"truncated": 0, "split": 0, "dropped as overlong": 0, "dropped with no target token": 0}
    full = np.zeros((0, 2), np.int64)
    if cfg.overlong == "split" and not documents.masked and seq_len > 1:
        whole = lengths // seq_len
        full = np.stack([docs, whole], axis=1)[whole > 0]
        doc = docs[lengths % seq_len > 0]
        start, end = whole[doc] * seq_len, lengths[doc]
        counts["split"] = int(overlong.sum())
    elif cfg.overlong == "split":
        per_doc = -(-lengths // seq_len)
        doc = np.repeat(docs, per_doc)
        start = (np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)) * seq_len
        end = np.minimum(start + seq_len, lengths[doc])
        counts["split"] = int(overlong.sum())
    elif cfg.overlong == "truncate":
        doc, start, end = docs, np.zeros_like(docs), np.minimum(lengths, seq_len)
        counts["truncated"] = int(overlong.sum())
    else:
        doc = docs[~overlong]
        start, end = np.zeros_like(doc), lengths[doc]
        counts["dropped as overlong"] = int(overlong.sum())
    if documents.masked:
        keep = np.array([documents.has_target(int(d), int(s) + 1, int(e)) for d, s, e in zip(doc, start, end)],
                        dtype=bool)
    else:
        keep = end - start > 1
    counts["dropped with no target token"] = int((~keep).sum())
    pieces = np.stack([doc, start, end], axis=1)[keep] if len(doc) else np.zeros((0, 3), np.int64)
    said = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    if said:
        log.info("data: of %d rows (data.seq_len=%d, data.overlong=%s): %s", len(lengths), seq_len, cfg.overlong, said)
    if documents.masked and overlong.any():
        warn_of_cut_targets(cfg, documents, overlong, doc[keep], start[keep], end[keep])
    if not len(pieces) and not len(full):
        key = "data.overlong" if counts["dropped as overlong"] else "data.train_on"
        raise ConfigError(f"{key}={getattr(cfg, key.split('.')[1])}: every one of the {len(lengths)} rows was "
                          f"dropped ({said}); raise data.seq_len, or set data.overlong=truncate or split")
    return full, pieces


def warn_of_cut_targets(cfg, documents: Documents, overlong: np.ndarray, doc, start, end) -> None:
    """A warning where fitting the rows to data.seq_len took target tokens away (chat or prompt/completion
    rows whose answers are cut): the share of the target tokens lost, the rows left with none, the longest
    row and the data.seq_len that would hold it. A piece's first token is no target in a block (nothing
    before it predicts it), nor is a row's first."""
    cut_rows = np.flatnonzero(overlong)
    kept = dict.fromkeys(cut_rows.tolist(), 0)
    for d, s, e in zip(doc.tolist(), start.tolist(), end.tolist()):
        if d in kept:
            kept[d] += documents.targets(d, s + 1, e)
    had = {d: documents.targets(d, 1, int(documents.lengths[d])) for d in kept}
    lost = sum(had[d] - kept[d] for d in kept)
    if not lost:
        return
    total = documents.all_targets()
    emptied = sum(1 for d in kept if had[d] and not kept[d])
    longest = int(documents.lengths.max())
    log.warning("data: data.seq_len=%d (data.overlong=%s) cuts %.0f%% of the target tokens, the ones trained on: %d "
                "of %d rows lose some, %d keep none; the longest row has %d tokens, so data.seq_len=%d would hold "
                "every row", cfg.seq_len, cfg.overlong, 100 * lost / max(total, 1), len(kept), len(documents.lengths),
                emptied, longest, longest)


class FreeSpace:
    """Open blocks by their free tokens: the tightest fit for a length (the fewest free tokens that
    hold it, then the lowest block) in O(log seq_len), so planning stays fast for millions of pieces."""

    def __init__(self, seq_len: int):
        self.size = 1 << seq_len.bit_length()  # leaves: free tokens 0..seq_len
        self.count = [0] * (2 * self.size)  # open blocks under each node of a binary tree over the leaves
        self.blocks: dict[int, list[int]] = {}  # free tokens -> heap of blocks

    def add(self, free: int, block: int) -> None:
        heapq.heappush(self.blocks.setdefault(free, []), block)
        self._count(free, 1)

    def take(self, length: int) -> tuple[int, int] | None:
        free = self._first_at_least(length)
        if free is None:
            return None
        self._count(free, -1)
        return free, heapq.heappop(self.blocks[free])

    def _count(self, free: int, change: int) -> None:
        i = free + self.size
        while i:
            self.count[i] += change
            i >>= 1

    def _first_at_least(self, low: int) -> int | None:
        i = low + self.size
        if self.count[i]:
            return low
        while i > 1:  # up, until a right sibling holds an open block
            if not i & 1 and self.count[i + 1]:
                i += 1
                break
            i >>= 1
        else:
            return None
        while i < self.size:  # down, to its leftmost open leaf
            i = 2 * i if self.count[2 * i] else 2 * i + 1
        return i - self.size


def best_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Pieces into blocks of seq_len, best fit, longest first (deterministic, ties in order):
    the pieces grouped by block (in the order they were placed) and each block's first entry."""
    order = np.argsort(-lengths, kind="stable")
    block_of = np.empty(len(lengths), dtype=np.int64)
    spaces, blocks = FreeSpace(seq_len), 0
    for i in order.tolist():
        length = int(lengths[i])
        fit = spaces.take(length)
        if fit is None:
            fit, blocks = (seq_len, blocks), blocks + 1
        free, b = fit
        block_of[i] = b
        if free - length:
            spaces.add(free - length, b)
    placed = np.empty(len(lengths), dtype=np.int64)
    placed[order] = np.arange(len(lengths))
    members = np.lexsort((placed, block_of))
    return members, np.searchsorted(block_of[members], np.arange(blocks + 1))


class PlannedBlocks(TrainingSet):
    """Training blocks planned over documents, gathered when asked for: the same dict items as
    PackedBlocks (input_ids, labels, position_ids, and attention_mask for packing=none).

    documents/none: first one block per full piece (`full` rows (document, count): that document's
    tokens [j L, (j + 1) L) for j < count), then blocks of `pieces` rows (document, start, end),
    block F + b holding pieces[members[first[b]:first[b + 1]]]. stream: the documents `docs` end to
    end, block b their tokens [b L, (b + 1) L).
    """

    def __init__(self, documents: Documents, seq_len: int, pad: int, packing: str, pieces=None, docs=None,
                 full=None):
        self.documents, self.seq_len, self.pad, self.packing = documents, seq_len, pad, packing
        if packing == "stream":
            self.docs = docs
            self.ends = np.cumsum(documents.lengths[docs])  # where each document ends in the stream
            self.count = int(self.ends[-1]) // seq_len if len(docs) else 0
        else:
            self.pieces, self.full_docs, self.full_ends = pieces, full[:, 0], np.cumsum(full[:, 1])
            self.full_blocks = int(self.full_ends[-1]) if len(full) else 0
            if packing == "documents":  # full pieces leave no room: best fit places the others alone
                self.members, self.first = best_fit(pieces[:, 2] - pieces[:, 1], seq_len)
            else:
                self.members, self.first = np.arange(len(pieces)), np.arange(len(pieces) + 1)
            self.count = self.full_blocks + len(self.first) - 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        if not 0 <= b < self.count:
            raise IndexError(b)
        if self.packing == "stream":
            return self._stream_block(b)
        L = self.seq_len
        ids, labels = np.full(L, self.pad, dtype=np.int64), np.full(L, IGNORE, dtype=np.int64)
        positions, at = np.zeros(L, dtype=np.int64), 0
        if b < self.full_blocks:
            k = int(np.searchsorted(self.full_ends, b, side="right"))
            j = b - (int(self.full_ends[k - 1]) if k else 0)
            members = [(int(self.full_docs[k]), j * L, (j + 1) * L)]
        else:
            b -= self.full_blocks
            members = self.pieces[self.members[self.first[b]:self.first[b + 1]]].tolist()
        for d, s, e in members:
            piece, targets = self.documents.read(d, s, e)
            n = len(piece)
            ids[at:at + n] = piece
            labels[at:at + n] = piece if targets is None else np.where(targets, piece, IGNORE)
            labels[at] = IGNORE
            positions[at:at + n] = np.arange(n)
            at += n
        item = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.packing == "none":
            item["position_ids"] = torch.arange(L)
            item["attention_mask"] = torch.from_numpy((np.arange(L) < at).astype(np.int64))
        else:
            positions[at:] = np.arange(L - at)  # the padding, a row of its own
            item["position_ids"] = torch.from_numpy(positions)
        return item

    def _stream_block(self, b: int) -> dict[str, torch.Tensor]:
        L, start = self.seq_len, b * self.seq_len
        ids, labels, at = np.empty(L, dtype=np.int64), np.empty(L, dtype=np.int64), 0
        k = int(np.searchsorted(self.ends, start, side="right"))
        while at < L:
            doc_start = int(self.ends[k - 1]) if k else 0
            s = start + at - doc_start
            e = min(int(self.ends[k]) - doc_start, s + L - at)
            piece, targets = self.documents.read(int(self.docs[k]), s, e)
            ids[at:at + len(piece)] = piece
            labels[at:at + len(piece)] = piece if targets is None else np.where(targets, piece, IGNORE)
            at, k = at + len(piece), k + 1
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.arange(L)}


def plan_blocks(cfg, documents: Documents, held_out: np.ndarray, pad: int) -> tuple[PlannedBlocks, PlannedBlocks]:
    """Train and validation blocks: the held-out documents' pieces are validation's, the rest train's."""
    from trainloop.errors import ConfigError

    valid_doc = np.zeros(len(documents), dtype=bool)
    valid_doc[held_out] = True
    if cfg.packing == "stream":
        parts = [PlannedBlocks(documents, cfg.seq_len, pad, "stream", docs=np.flatnonzero(side))
                 for side in (~valid_doc, valid_doc)]
    else:
        full, pieces = fit_pieces(cfg, documents)
        full_valid, pieces_valid = valid_doc[full[:, 0]], valid_doc[pieces[:, 0]]
        parts = [PlannedBlocks(documents, cfg.seq_len, pad, cfg.packing, pieces=pieces[side], full=full[full_side])
                 for side, full_side in ((~pieces_valid, ~full_valid), (pieces_valid, full_valid))]
    for part in parts:
        part.overlong = cfg.overlong
    if not len(parts[0]) or not len(parts[1]):
        raise ConfigError(f"the data holds {len(parts[0])} training and {len(parts[1])} validation block(s) of "
                          f"data.seq_len={cfg.seq_len} tokens: too little to train and validate; "
                          "add data or lower data.seq_len")
    return parts[0], parts[1]
