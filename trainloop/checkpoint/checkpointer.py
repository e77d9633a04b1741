"""Checkpoints: atomic saves under RUN_DIR/checkpoints/step_NNNNNNN, resume, retention.

A save is written to a temporary folder by every rank (the strategy's save_state: model, optimizer,
scheduler, scaler, every RNG per rank, the accumulation micro-step); the main process then commits
it (trainloop.checkpoint.commit: config, checksums, trainer state, fsync, COMPLETE, rename, `latest`,
retention). A folder without COMPLETE is never loaded (a save cut short by SIGKILL leaves
`.tmp_step_*`, removed at the next start). The parameters are checked to be finite on every rank
first, and every rank hears whether any failed to write its part (trainloop.checkpoint.agreement).
A resume takes the newest checkpoint that is whole (trainloop.checkpoint.integrity) and agrees with
this run's config (trainloop.checkpoint.compatibility). The checkpoints folder must be on a file
system every node sees.

Under FSDP2 (fsdp=full_shard) the model and optimizer are written in torch.distributed.checkpoint
format instead, one shard file per rank (trainloop/parallel/dcp.py), and load at any world size. With
checkpoint.async_save they are written in the background while training goes on
(trainloop.checkpoint.async_save).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from trainloop.checkpoint.agreement import any_rank_failed, attempt, parameters_finite
from trainloop.checkpoint.async_save import AsyncSaves
from trainloop.checkpoint.commit import commit, no_space_left
from trainloop.checkpoint.compatibility import (check_format, check_world_size_change, comparable, global_batch,
                                                refuse_changes, run_fingerprint)
from trainloop.checkpoint.integrity import (COMPLETE, KEY, TMP_PREFIX, complete, file_sizes, read_state,
                                            record, record_rank_files, step_of, why_unloadable)
from trainloop.errors import CheckpointError, ConfigError, NonFiniteError
from trainloop.optim.optimizers import keep_configured_lr
from trainloop.rundir import same_command

log = logging.getLogger("trainloop")


class Checkpointer:
    def __init__(self, cfg, strategy, run_dir: Path):
        self.cfg = cfg
        self.recorded = cfg  # what its saves record as the run's config (record_config: a settled batch in it)
        self.strategy = strategy  # trainloop.parallel: how model and optimizer are saved and loaded
        self.every = cfg.checkpoint.every_steps
        self.keep_last = cfg.checkpoint.keep_last
        self.accelerator = strategy.accelerator
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.data_fingerprint: dict = {}  # set by check_data once the data is built
        self.resuming: tuple[Path, dict] | None = None  # (checkpoint, its fingerprint) once found
        self.objective = None  # the run's objective (trainloop.objectives), once built: its rank_state is saved too
        # DCP (trainloop.parallel.dcp) writes in the background
        self.async_saves = (AsyncSaves(self.accelerator, cfg.trainer.collective_timeout_s)
                            if strategy.saves_async and cfg.checkpoint.async_save else None)

    def record_config(self, recorded) -> None:
        """Once the run is built: the config its saves record, the batch it takes included (one
        trainer.auto_batch_size settled: trainloop.memory.batch_size.with_batch)."""
        self.recorded = recorded

    @property
    def fingerprint(self) -> dict:
        """What this run's saves record, from the config as the run applied it (a batch size
        settled by trainer.auto_batch_size included), and the data's own fingerprint."""
        fingerprint = run_fingerprint(self.recorded, self.strategy.dp_size)
        if self.strategy.keeps_world_size(self.cfg):  # each rank's files hold its partition: cp ranks' too
            fingerprint["parallel.cp_size"] = self.strategy.cp_size
        return {**fingerprint, **self.data_fingerprint}

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return complete(self.root)

    def last_good(self) -> str:
        found = self.complete()
        return str(found[-1]) if found else "none (no checkpoint was saved yet)"

    def back_to_last_good(self) -> str:
        """After non-finite numbers: where to go back to, and the command that does."""
        return (f"The last good checkpoint is {self.last_good()}: to resume from it with a lower learning rate, "
                f"run {same_command(self.run_dir, 'optimizer.lr=LOWER')}")

    def save(self, state, model) -> Path:
        acc = self.accelerator
        final = self.root / f"step_{state.step:07d}"
        self._settle()  # one save at a time: the one in flight commits first
        if not parameters_finite(acc, model):
            raise NonFiniteError(f"the parameters are not finite after optimizer step {state.step}; "
                                 f"not saving them. {self.back_to_last_good()}")
        tmp = self.root / f"{TMP_PREFIX}{final.name}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if self.async_saves is not None:
            self._agree_saved(attempt(self._start_async, tmp, final, model, state.state_dict(), self.fingerprint),
                              tmp, final)
            log.info("saving checkpoint %s in the background after step %d; training goes on", final, state.step)
            return final
        self._agree_saved(attempt(self._save_state, tmp, model), tmp, final)
        # every rank's files are written (and closed) from here on
        failure = (attempt(self._commit, tmp, final, state.state_dict(), self.fingerprint)
                   if acc.is_main_process else None)
        self._agree_saved(failure, tmp, final)
        return final

    def poll(self, step: int) -> list[dict]:
        """Every optimizer step, on every rank: finish an asynchronous save whose shards are all
        written (the main process commits it: rank 0's future is done only then); return the
        records of the saves committed since the last call, for metrics.jsonl (main process)."""
        saves = self.async_saves
        if saves is None:
            return []
        saves.steps_done = step
        if saves.written():
            save = saves.in_flight
            failure = saves.finish(self._commit)
            if failure is not None:  # DCP reports a rank's failure to every rank: each stops here
                self._raise_save_failure(failure, save.tmp, save.final)
        committed, saves.committed = saves.committed, []
        return committed

    def wait(self, step: int) -> list[dict]:
        """Every rank, at the end of training (and at a preemption's stop, after its save): wait
        for the save in flight, commit it, and agree that it is committed."""
        if self.async_saves is not None:
            self.async_saves.steps_done = step  # what its record says training had reached
        self._settle()
        return self.poll(step)

    def _settle(self) -> None:
        """Every rank, together: finish the last asynchronous save (if this rank has not in poll)
        and agree on its outcome, so that no rank goes on (or names the last good checkpoint)
        before the main process has committed it."""
        saves = self.async_saves
        if saves is None or saves.unsettled is None:
            return
        (tmp, final), saves.unsettled = saves.unsettled, None
        self._agree_saved(saves.finish(self._commit), tmp, final)

    def _raise_save_failure(self, failure: BaseException, tmp: Path, final: Path):
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise self._save_error(failure, tmp, final) from failure

    @property
    def adapter_only(self) -> bool:
        """With an adapter, checkpoints hold the trainable parameters only: the frozen base is
        rebuilt from its source (model.name_or_path, or the seeded init) at every start."""
        return self.cfg.adapter.name != "none"

    def _save_state(self, directory: Path, model) -> None:
        self._save_objective(directory)
        self.strategy.save_state(directory, model, self.adapter_only, record)
        record_rank_files(directory, self.accelerator.process_index)

    def _start_async(self, tmp: Path, final: Path, model, state: dict, fingerprint: dict) -> None:
        self._save_objective(tmp)
        self.async_saves.start(tmp, final, model, self.adapter_only, state, fingerprint)

    def _save_objective(self, directory: Path) -> None:
        """This rank's objective state (e.g. GRPO's completions inside a num_iterations window), if any."""
        import torch

        held = self.objective.rank_state() if self.objective is not None else None
        if held is not None:
            torch.save(held, directory / f"objective_{self.accelerator.process_index}.pt")

    def _load_objective(self, path: Path, saved_fingerprint: dict) -> None:
        """The objective's state of this rank, where the checkpoint has it and was saved by as many
        data-parallel ranks (each held its own share of the batch); else the objective starts without."""
        import torch

        file = path / f"objective_{self.accelerator.process_index}.pt"
        if self.objective is None or not file.is_file():
            return
        if saved_fingerprint.get("world_size") != self.fingerprint.get("world_size"):
            log.warning("%s holds each rank's objective state of %s data-parallel ranks, not %s: not loaded",
                        path.name, saved_fingerprint.get("world_size"), self.fingerprint.get("world_size"))
            return
        self.objective.load_rank_state(torch.load(file, map_location=self.strategy.device, weights_only=True))

    def _load_state(self, path: Path, model) -> None:
        self.strategy.load_state(path, model, self.adapter_only)

    def _agree_saved(self, failure: BaseException | None, tmp: Path, final: Path) -> None:
        """A barrier that also tells every rank whether any rank failed to write its part, so
        none waits forever for a rank that failed; each then stops with the message."""
        if not any_rank_failed(self.accelerator, failure):
            return
        error = self._save_error(failure, tmp, final)
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error

    def _save_error(self, failure: BaseException | None, tmp: Path, final: Path) -> BaseException:
        previous = self.complete()
        needed = sum(file_sizes(previous[-1]).values()) if previous else 0
        resumes = (f"the previous checkpoint {previous[-1]} is intact, and running "
                   f"{same_command(self.run_dir)} again resumes from it" if previous
                   else "no checkpoint was saved before it")
        if failure is None:
            return CheckpointError(f"saving checkpoint {final} failed on another rank (see its message); {resumes}")
        if not no_space_left(failure, tmp if tmp.exists() else self.root, needed):
            return failure  # unexpected: its own traceback
        free = shutil.disk_usage(tmp if tmp.exists() else self.root).free
        return CheckpointError(
            f"no space left on device for checkpoint {final} ({free / 2**20:.1f} MiB free there; a "
            f"checkpoint takes {needed / 2**20:.1f} MiB). The unfinished save was removed; {resumes}. "
            "Free space, lower checkpoint.keep_last (a save needs room for one checkpoint more), "
            "or move hydra.run.dir to a bigger disk")

    def _commit(self, tmp: Path, final: Path, state: dict, fingerprint: dict) -> None:
        """Main process: the durable commit (trainloop.checkpoint.commit), with this run's config."""
        commit(tmp, final, {"state": state, "fingerprint": fingerprint, "max_steps": self.cfg.trainer.max_steps},
               OmegaConf.to_yaml(self.recorded, resolve=True), self.keep_last)

    def remove_partial(self) -> None:
        """Remove what a save cut short (SIGKILL, node failure) left behind; main process only."""
        if not (self.accelerator.is_main_process and self.root.is_dir()):
            return
        for partial in self.root.glob(TMP_PREFIX + "*"):
            log.warning("removing %s: a save there did not complete", partial)
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.unlink(missing_ok=True)

    def find_resume(self) -> Path | None:
        """The checkpoint checkpoint.resume names, checked against this run's config. The main
        process decides and every rank takes its answer: all load the same checkpoint."""
        from accelerate.utils import broadcast_object_list

        self.remove_partial()
        outcome = [None, "the main process failed while choosing a checkpoint (see its traceback)"]
        try:
            if self.accelerator.is_main_process:
                path = self._choose_resume()
                outcome = [None if path is None else str(path), None]
        except ConfigError as err:
            outcome = [None, str(err)]
        finally:
            outcome = broadcast_object_list(outcome)
        if outcome[1] is not None:
            raise ConfigError(outcome[1])
        if outcome[0] is None:
            return None
        path = Path(outcome[0])
        self.resuming = (path, read_state(path)["fingerprint"])
        return path

    def _choose_resume(self) -> Path | None:
        spec = self.cfg.checkpoint.resume
        found = self.complete()
        if spec is None:
            if found:
                raise ConfigError(
                    f"checkpoint.resume=null, but {self.root} already holds checkpoints (latest "
                    f"{found[-1].name}) that this run would mix with its own. Use "
                    "checkpoint.resume=auto to continue them, or a new hydra.run.dir")
            return None
        if spec == "auto":
            if not found:
                log.info("checkpoint.resume=auto: no complete checkpoint in %s; starting fresh", self.root)
                return None
            path = self._newest_loadable(found)
            found = self.complete()  # without the broken ones, now set aside
        else:
            path = Path(spec).expanduser()
            if not (path / COMPLETE).is_file():
                raise ConfigError(f"checkpoint.resume={spec!r} is not a complete checkpoint "
                                  f"(no {COMPLETE} marker); give a checkpoints/step_NNNNNNN folder, "
                                  "or auto for the latest in the run directory")
            problem = why_unloadable(path)
            if problem:
                raise CheckpointError(f"checkpoint.resume={spec!r} does not load: {problem}. "
                                      + self._intact_sibling_hint(path))
        saved = read_state(path)
        if KEY not in saved:  # refusing would strand every run saved before them
            log.warning("checkpoint %s was saved before trainloop recorded checksums: its files are checked "
                        "by size and format only", path)
        check_format(path, saved["fingerprint"], self.fingerprint)
        keeps_world_size = self.strategy.keeps_world_size(self.cfg)
        check_world_size_change(path, saved["fingerprint"], self.fingerprint, keeps_world_size)
        refuse_changes(path, *comparable(saved["fingerprint"], self.fingerprint, reshards=keeps_world_size is None,
                                         auto_batch_size=self.cfg.trainer.auto_batch_size))
        newer = [p.name for p in found if step_of(p) > saved["state"]["step"]]
        if newer:
            raise ConfigError(f"checkpoint.resume={spec!r}: {self.root} holds later checkpoints "
                              f"({', '.join(newer)}) that this run would mix with its own; resume "
                              "into a new hydra.run.dir (a checkpoint path works from any run dir)")
        if saved.get("max_steps") != self.cfg.trainer.max_steps:
            log.warning("trainer.max_steps changed since %s (%s -> %s): the learning-rate schedule "
                        "now runs to %s", path.name, saved.get("max_steps"),
                        self.cfg.trainer.max_steps, self.cfg.trainer.max_steps)
        return path

    def _newest_loadable(self, found: list[Path]) -> Path:
        """checkpoint.resume=auto: the newest checkpoint that loads. Newer broken ones are moved
        aside to broken_step_N (kept for a look), so retention and later resumes never count them."""
        broken = []
        for path in reversed(found):
            problem = why_unloadable(path)
            if problem is None:
                break
            broken.append((path, problem))
        else:
            raise CheckpointError(f"no checkpoint in {self.root} loads: "
                                  + "; ".join(problem for _, problem in broken)
                                  + ". Remove them to start afresh, or train in a new hydra.run.dir")
        for bad, problem in broken:
            aside = self.root / f"broken_{bad.name}"
            while aside.exists():
                aside = aside.with_name(aside.name + "_")
            bad.rename(aside)
            log.warning("checkpoint %s does not load: %s. Resuming from the older %s instead; the "
                        "broken one is moved to %s", bad.name, problem, path.name, aside)
        return path

    def _intact_sibling_hint(self, path: Path) -> str:
        siblings = sorted((p for p in path.parent.glob("step_*") if (p / COMPLETE).is_file() and p != path),
                          key=step_of, reverse=True)
        intact = next((p for p in siblings if why_unloadable(p) is None), None)
        return (f"The newest intact checkpoint beside it is {intact}" if intact
                else "No intact checkpoint is beside it")

    def check_data(self, data_fingerprint: dict) -> None:
        """The data is built after find_resume: add what identifies it (tokenizer, packed blocks)
        to what each save records, and refuse a resume from a checkpoint trained on other data."""
        self.data_fingerprint = data_fingerprint
        if self.resuming is not None:
            refuse_changes(self.resuming[0], self.resuming[1], data_fingerprint)

    def load(self, path: Path, state, model, scheduler) -> None:
        # Model, optimizer, scheduler, scaler, RNG states and accelerate's micro-step counter;
        # the data position is in `state`: samples of the epoch's global order, over all ranks.
        configured = list(scheduler.base_lrs)
        self._load_state(path, model)
        self._restore_rng_of_a_new_rank(path)
        saved = keep_configured_lr(scheduler, configured)
        if saved is not None and self.accelerator.is_main_process:
            log.warning("optimizer.lr changed since %s (%s -> %s): the learning-rate schedule goes on from it",
                        path.name, saved[0] if len(set(saved)) == 1 else saved,
                        configured[0] if len(set(configured)) == 1 else configured)
        saved_state = read_state(path)
        state.load_state_dict(saved_state["state"])
        self._load_objective(path, saved_state["fingerprint"])
        log.info("resumed from %s at step %d (epoch %d, batch %d): sample %d of the epoch's order", path,
                 state.step, state.epoch, state.samples_in_epoch // global_batch(self.fingerprint),
                 state.samples_in_epoch)

    def _restore_rng_of_a_new_rank(self, path: Path) -> None:
        """A rank the saving run did not have (a resume on more processes) has no random_states
        file of its own; it takes rank 0's. Under DDP and FSDP2 every rank is seeded alike (set_seed)
        and draws the same numbers (the same shapes), so that is the state it would have had."""
        acc = self.accelerator
        if (path / f"random_states_{acc.process_index}.pkl").is_file():
            return
        import random

        import numpy as np
        import torch

        states = torch.load(path / "random_states_0.pkl", weights_only=False)
        random.setstate(states["random_state"])
        np.random.set_state(states["numpy_random_seed"])
        torch.set_rng_state(states["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
            torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
        acc.step = states.get("step", acc.step)

