"""logging.profile_steps=[START, END]: a torch.profiler trace of those optimizer steps (and on CUDA
a memory snapshot) in RUN_DIR/profile/. Nothing is built when profile_steps is null."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("trainloop")


class StepProfiler:
    """Records optimizer steps START..END (1-based, inclusive, as metrics.jsonl counts them).

    The loop calls step(n) after each optimizer step n and close() when it ends or stops. The
    step before START is the profiler's warm-up, so START itself is recorded at full fidelity."""

    @classmethod
    def build(cls, cfg_logging, accelerator, run_dir, done: int) -> StepProfiler | None:
        """None (no cost) without profile_steps, on a rank not profiled, or when a resumed run
        (`done` steps already taken) is past the window."""
        window = cfg_logging.profile_steps
        if window is None or (cfg_logging.profile_ranks == "main" and not accelerator.is_main_process):
            return None
        start, end = window
        if done >= end:
            return None
        return cls(max(start, done + 1), end, accelerator.process_index, accelerator.device, Path(run_dir), done)

    def __init__(self, first: int, end: int, rank: int, device: torch.device, run_dir: Path, done: int):
        self.first, self.end, self.rank, self.done = first, end, rank, done
        self.dir = run_dir / "profile"
        self.cuda = device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        idle = first - 1 - done  # steps run before the window starts
        warmup = min(1, idle)
        schedule = torch.profiler.schedule(wait=idle - warmup, warmup=warmup, active=end - first + 1, repeat=1)
        self.profile = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._save,
            record_shapes=True, profile_memory=True, with_stack=False)
        self.profile.start()
        self.memory = False
        if idle == 0:
            self._record_memory()

    def step(self, done: int) -> None:
        """Optimizer step `done` has finished."""
        self.done = done
        self.profile.step()  # saves the trace (on_trace_ready) after step END
        if done == self.first - 1:
            self._record_memory()
        elif done == self.end:
            self._dump_memory()

    def close(self) -> None:
        """At the end of training or a stop: a window cut short is saved with the steps it holds."""
        self.profile.stop()
        self._dump_memory()

    def _save(self, profile) -> None:
        if self.done < self.first:  # stopped before the window began: nothing recorded
            return
        last = min(self.done, self.end)  # less than END when the run stopped inside the window
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}_steps{self.first}-{last}.pt.trace.json"
        profile.export_chrome_trace(str(path))
        log.info("profiler: steps %d-%d of rank %d in %s; open it at https://ui.perfetto.dev, "
                 "or run tensorboard --logdir %s", self.first, last, self.rank, path, self.dir)

    def _record_memory(self) -> None:
        if self.cuda and not self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            self.memory = True

    def _dump_memory(self) -> None:
        if self.memory:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"memory_rank{self.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False
            log.info("profiler: memory snapshot of rank %d in %s; drop it on https://pytorch.org/memory_viz",
                     self.rank, path)
