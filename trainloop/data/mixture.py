"""Weighted mixtures of data sources (data.sources): one dataset per source, interleaved by weight.

Each source is read exactly as the data option reads data.path (build_datasets with the source's
path), and keeps its own validation split. Training blocks come from one endless schedule: its
position p names a source and that source's draw number, so the proportions hold on every
prefix (two sources: each within half a block of its share) and the order is a function of
trainer.seed alone. A loader epoch is a window of that schedule, so no source's order restarts at an epoch.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainloop.data.order import Permutation
from trainloop.data.sets import TrainingSet


def source_names(data_cfg) -> list[str]:
    """The key of each source in metrics.jsonl and the trackers: its name, else the stem of its file
    or folder (`chat` for data/chat.jsonl), else, where two stems or a stem and a name are alike,
    or for a glob, its path."""
    sources = data_cfg.sources or []
    stems = [s.name or Path(s.path).stem for s in sources]
    return [s.name or (stem if stems.count(stem) == 1 and not any(c in s.path for c in "*?[") else s.path)
            for s, stem in zip(sources, stems)]


class Schedule:
    """Which source fills each position of the mixture: source s's k-th draw comes at time
    (k + 1/2) / w_s (Webster's apportionment), positions follow time (ties: the lower source).
    A prefix reaching time t holds round(t * w_s) draws of source s, so on every prefix of n
    positions each of k sources is within (k + 1) / 2 blocks of n * w_s / sum(w) (half a block
    measured for two sources; a window, twice that). Exact rational arithmetic:
    position p is computed directly, the same on every rank and worker, at any p."""

    def __init__(self, weights: list[float]):
        self.weights = [Fraction(repr(float(w))) for w in weights]
        self.total = sum(self.weights)

    def _before(self, s: int, t: Fraction) -> int:
        """Source s's draws that come strictly before time t."""
        return max(0, math.ceil(t * self.weights[s] - Fraction(1, 2)))

    def at(self, p: int) -> tuple[int, int]:
        """(source, that source's draw number) of position p."""
        n = len(self.weights)
        # The (p+1)-th draw's time lies in [lo, hi]: each source's count is within 1/2 of t * w_s.
        lo, hi = max(Fraction(0), (p - n) / self.total), (p + 1 + n) / self.total
        before = [self._before(s, lo) for s in range(n)]
        draws = []
        for s, w in enumerate(self.weights):
            k = before[s]
            while (k + Fraction(1, 2)) / w <= hi:
                draws.append(((k + Fraction(1, 2)) / w, s, k))
                k += 1
        draws.sort()
        _, s, k = draws[p - sum(before)]
        return s, k


class MixtureBlocks(TrainingSet):
    """The blocks of several datasets in weighted proportion: item i is position
    epoch * len(self) + i of the schedule; each item is its source's item plus `source` (int64).

    A source's draws go through a permutation of its blocks drawn from (seed, source, pass), a
    new one each time the source has given all its blocks: a small source is re-used (its passes
    = its share of the positions / its blocks); a large one repeats nothing until it is used up.
    With shuffle=False the draws go in order, one pass (the validation union).
    Its order is its own (TrainingSet's protocol): the run reads it in order (orders_itself: GlobalOrder
    without shuffling), trims its epoch to whole batches (whole_batches) and calls set_epoch.
    """

    orders_itself = True

    def __init__(self, sources: list[Dataset], weights: list[float], seed: int, length: int | None = None,
                 shuffle: bool = True):
        self.sources, self.seed, self.shuffle = sources, seed, shuffle
        self.schedule = Schedule(weights)
        total = sum(weights)
        # One epoch: until the source that runs out first under its weight has given each block once.
        self.length = length if length is not None else min(
            int(len(d) * total / w) for d, w in zip(sources, weights))
        self.epoch = 0

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """Called by the loop (loop.batches_forever) each epoch: the next window of the schedule."""
        self.epoch = epoch

    def whole_batches(self, global_batch: int) -> None:
        """Trim an epoch to whole global batches, so the loader drops no tail and epochs meet."""
        if self.length >= global_batch:
            self.length -= self.length % global_batch

    def locate(self, i: int) -> tuple[int, int]:
        """(source, block of that source) of item i in this epoch."""
        s, k = self.schedule.at(self.epoch * self.length + i)
        n = len(self.sources[s])
        if not self.shuffle:
            return s, k % n
        passes, block = divmod(k, n)
        return s, int(Permutation(n, self.seed, s, passes)[block][0])  # a new order each pass over the source

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, block = self.locate(i)
        return {**self.sources[s][block], "source": torch.tensor(s, dtype=torch.long)}


def build_source_datasets(cfg, tokenizer, seed: int) -> tuple[MixtureBlocks, MixtureBlocks, list]:
    """Each source built as data.path would be; the training mixture, the validation union
    (every source's held-out blocks once, interleaved by their counts so that a
    trainer.eval_batches prefix reads every source), and the per-source (train, valid) pairs."""
    from omegaconf import OmegaConf

    from trainloop.data.loaders import build_datasets
    from trainloop.errors import ConfigError

    parts = []
    for i, source in enumerate(cfg.sources):
        try:
            parts.append(build_datasets(OmegaConf.merge(cfg, {"path": source.path, "sources": None}), tokenizer, seed))
        except ConfigError as err:
            raise ConfigError(f"data.sources[{i}] (path {source.path}): {err}") from None
    weights = [float(s.weight) for s in cfg.sources]
    train = MixtureBlocks([t for t, _ in parts], weights, seed)
    valid_sizes = [len(v) for _, v in parts]
    valid = MixtureBlocks([v for _, v in parts], valid_sizes, seed, length=sum(valid_sizes), shuffle=False)
    return train, valid, parts


def build_training_data(cfg, tokenizer, seed: int, tools: list[dict] | None = None) -> tuple[Dataset, Dataset, dict]:
    """The run's training and validation datasets and their fingerprint: a mixture when
    data.sources is set, else data.path's (or the built-in corpus's) blocks. `tools`: build_datasets'."""
    from trainloop.data.loaders import build_datasets, data_fingerprint

    if not cfg.sources:
        train, valid = build_datasets(cfg, tokenizer, seed, tools)
        return train, valid, data_fingerprint(tokenizer, train, valid)
    train, valid, parts = build_source_datasets(cfg, tokenizer, seed)
    prints = [data_fingerprint(tokenizer, t, v) for t, v in parts]
    content = "; ".join(f"{s.name or s.path} x {s.weight}: {p['data content']}"  # as checkpoints have it
                        for s, p in zip(cfg.sources, prints))
    return train, valid, {**prints[0], "data content": content}
