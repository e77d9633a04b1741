"""The order of training samples: a function of (trainer.seed, epoch) alone, whatever the world size.

Each epoch is one permutation of the training blocks. A global batch is `data.batch_size x
gradient accumulation x processes` consecutive samples of it, and rank r of W takes, at
micro-step m, the samples [m*B*W + r*B, m*B*W + (r+1)*B) of the global batch. So one optimizer
step sees the same samples on 2 processes at batch 4 as on 1 process at batch 8, and a position
in the epoch is a number of samples, which means the same at any world size. The permutation
is the one accelerate's seedable sampler drew (torch.randperm seeded with seed + epoch), and the
split the one its batch sharding made, so checkpoints saved before this module resume in place.
The last incomplete global batch of an epoch is dropped: every optimizer step has the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))


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
        order = (epoch_permutation(self.num_samples, self.seed, self.epoch) if self.shuffle
                 else torch.arange(self.num_samples))
        micro = self.batch_size * self.world_size  # one micro-step of every rank
        first = self.start + self.rank * self.batch_size
        for at in range(first, self.samples_per_epoch, micro):
            yield order[at:at + self.batch_size].tolist()

