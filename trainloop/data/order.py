"""The order of training samples: a function of (trainer.seed, epoch) alone, whatever the world size.

Each epoch is one permutation of the training blocks. A global batch is `data.batch_size x
gradient accumulation x processes` consecutive samples of it, and rank r of W takes, at
micro-step m, the samples [m*B*W + r*B, m*B*W + (r+1)*B) of the global batch. So one optimizer
step sees the same samples on 2 processes at batch 4 as on 1 process at batch 8, and a position
in the epoch is a number of samples, which means the same at any world size. The last
incomplete global batch of an epoch is dropped: every optimizer step has the same samples.

The validation split is read in the same layout, unshuffled and to its last item, each item by
one rank (`ValidationOrder`): evaluations count every item once at any world size.

The permutation is computed sample by sample (`Permutation`), a few thousand at a time, never held whole: its
memory does not grow with the corpus, which at pre-training scale has billions of blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
CHUNK = 4096  # samples whose place in the epoch GlobalOrder computes at a time


class Permutation:
    """A seeded pseudo-random bijection of range(n), evaluated index by index in O(1) memory.

    A balanced Feistel network over the smallest even number of bits that covers n is a bijection
    of [0, 2^bits) whatever its round function (here a splitmix64 finaliser); values >= n are
    encrypted again until they fall in [0, n) ("cycle walking"), which keeps it a bijection of
    range(n). 2^bits < 4n, so a value takes under 4 encryptions on average.
    """

    def __init__(self, n: int, *key: int):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        # 4 rounds (a Luby-Rackoff pseudo-random permutation), a 64-bit key each, from the key's hash
        self.keys = np.frombuffer(hashlib.sha256("/".join(map(str, key)).encode()).digest(), dtype=np.uint64)

    def _round(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
            h = (x ^ key) * _MIX[0]
            h = (h ^ (h >> np.uint64(30))) * _MIX[1]
            h = (h ^ (h >> np.uint64(27))) * _MIX[2]
        return (h ^ (h >> np.uint64(31))) & self.mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __getitem__(self, index) -> np.ndarray:
        """The images of an index or an array of indices in range(n)."""
        x = self._encrypt(np.atleast_1d(np.asarray(index, dtype=np.uint64)))
        outside = x >= self.n
        while outside.any():
            x[outside] = self._encrypt(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)


@dataclass
class GlobalOrder:
    """A DataLoader batch_sampler: this rank's micro-batches of the epoch, from a sample position on.

    `set_position(epoch, samples)` before iterating (the loop does, each epoch and at a resume).
    """

    num_samples: int
    seed: int
    batch_size: int  # per rank and micro-step
    accumulation: int
    world_size: int
    rank: int
    epoch: int = 0
    start: int = 0  # samples of the epoch consumed (over all ranks)
    shuffle: bool = True  # False: the dataset's own order (a mixture's schedule)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation * self.world_size

    @property
    def samples_per_epoch(self) -> int:
        return self.num_samples // self.global_batch * self.global_batch

    def set_position(self, epoch: int, samples: int) -> None:
        if samples % self.global_batch:
            raise ValueError(f"a position of {samples} samples is not at a global batch of {self.global_batch}")
        self.epoch, self.start = epoch, samples

    def __len__(self) -> int:
        """This rank's micro-batches in a whole epoch."""
        return self.samples_per_epoch // (self.batch_size * self.world_size)

    def __iter__(self):
        permutation = Permutation(self.num_samples, self.seed, self.epoch) if self.shuffle else None
        micro = self.batch_size * self.world_size  # one micro-step of every rank
        starts = range(self.start + self.rank * self.batch_size, self.samples_per_epoch, micro)
        # the permutation evaluated for about CHUNK samples at once (a few dozen numpy calls on small arrays:
        # once per micro-batch they cost as much as a tiny model's step), its images the same one by one
        per_chunk = max(1, CHUNK // self.batch_size)
        for c in range(0, len(starts), per_chunk):
            chunk = starts[c:c + per_chunk]
            samples = (np.asarray(chunk)[:, None] + np.arange(self.batch_size)).ravel()
            images = samples if permutation is None else permutation[samples]
            yield from images.reshape(len(chunk), self.batch_size).tolist()


@dataclass
class ValidationOrder:
    """A DataLoader batch_sampler over the validation split, in its order: each item goes to exactly
    one rank, laid out as an epoch is (rank r of W takes the samples [m*B*W + r*B, m*B*W + (r+1)*B)
    at micro-step m), up to the last item, however few the last micro-step holds. So an evaluation
    counts every item once at any world size, and its sums are the same over 1 process at batch 8
    as over 2 at batch 4.

    Every rank yields the same number of micro-batches, as a sharded model (ZeRO-3, FSDP2) needs
    every rank in every forward: a rank whose share of the last micro-steps is empty reads item 0
    again, a micro-batch the evaluation runs but does not count (only the first `counted` count).
    `max_batches` (trainer.eval_batches) counts global batches, `batch_size x accumulation x
    world_size` items each as a training step reads: the first max_batches x global batch items
    are read, the same ones under any layout of the same global batch. None: every item.
    """

    num_samples: int
    batch_size: int  # per rank and micro-step
    accumulation: int
    world_size: int
    rank: int
    max_batches: int | None = None

    @property
    def end(self) -> int:
        """The items read: the first `end` of the split."""
        if self.max_batches is None:
            return self.num_samples
        return min(self.num_samples, self.max_batches * self.batch_size * self.accumulation * self.world_size)

    def __len__(self) -> int:
        """Each rank's micro-batches: as many as the micro-steps that hold an item."""
        return -(-self.end // (self.batch_size * self.world_size))

    @property
    def counted(self) -> int:
        """This rank's micro-batches that hold items (the first ones): the rest are item 0 again."""
        return max(0, -(-(self.end - self.rank * self.batch_size) // (self.batch_size * self.world_size)))

    def __iter__(self):
        micro = self.batch_size * self.world_size
        for at in range(self.rank * self.batch_size, len(self) * micro, micro):
            yield list(range(at, min(at + self.batch_size, self.end))) or [0]
