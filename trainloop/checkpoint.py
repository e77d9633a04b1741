"""Checkpoints: atomic saves under RUN_DIR/checkpoints/step_NNNNNNN, resume, retention.

A save is written to a temporary folder by every rank (accelerate's save_state: model,
optimizer, scheduler, scaler, every RNG per rank, the accumulation micro-step), completed with
the config, every file's checksum (trainloop.integrity) and the trainer state, synced to disk,
marked COMPLETE, renamed into place, and only then named in `latest`. A folder without COMPLETE
is never loaded (a save cut short by SIGKILL leaves `.tmp_step_*`, removed at the next start),
and older checkpoints are removed only after a newer one is complete. The parameters are checked
to be finite first: a non-finite state is never saved over a good one. The checkpoints folder
must be on a file system every node sees.

Under FSDP2 (fsdp=full_shard) the model and optimizer are written in torch.distributed.checkpoint
format instead, one shard file per rank (trainloop/dcp.py), and load at any world size. With
checkpoint.async_save the shards are written in the background while training goes on; the main
process commits the folder (trainer state, COMPLETE, rename, `latest`) at the first optimizer step
after every rank's shard is written (poll), and a save, the end of training and a preemption
(which saves) wait for a save still in flight.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import zipfile
from pathlib import Path

from omegaconf import OmegaConf

from trainloop import integrity
from trainloop.errors import CheckpointError, ConfigError, NonFiniteError
from trainloop.objectives import keys_read
from trainloop.optim import keep_configured_lr
from trainloop.parallel.tensors import local_shard
from trainloop.rundir import same_command

log = logging.getLogger("trainloop")

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp_"



# DataLoader mechanics: they change how blocks reach the model, never which blocks or in what order.
DATA_MECHANICS = ("num_proc", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                  "multiprocessing_context")

# What may change when a run resumes: how long it trains and at what learning rate, how a step is
# computed, what is logged, evaluated and saved; never the model, adapter, data, loss or optimizer it
# trains with. A section named here may change whole, a key alone. run_fingerprint records the rest of
# RECORDED's sections and, of the others, the world size and FINGERPRINT_KEYS: a resume that changes
# one is refused. Every config key is one or the other (tests/test_fingerprint.py); README says which.
MAY_CHANGE_ON_RESUME = (
    "optimizer.lr", "scheduler", "trainer.max_steps",  # the schedule, from the configured lr (optim.keep_configured_lr)
    "trainer.max_grad_norm", "trainer.stop_at_step", "trainer.on_nonfinite", "trainer.collective_timeout_s",
    "trainer.log_every", "trainer.eval_every", "trainer.eval_batches", "logging", "eval",  # what is logged, evaluated
    "checkpoint",  # when it saves, what it keeps and resumes
    "precision", "compile", "optimizer.impl", "trainer.loss_chunk_tokens", "trainer.activation_offload",  # how
    "trainer.auto_batch_size", "trainer.auto_batch_size_budget_mb",  # the batch it settles is recorded
    "model.attn_implementation", "model.gradient_checkpointing",  # the same weights, another kernel or memory
    *(f"data.{key}" for key in DATA_MECHANICS),
    "objective.precompute_reference",  # DPO's reference log-probs, of the same starting model, kept or recomputed
    "deepspeed", "fsdp", "parallel",  # the strategy's settings but its files' format (FINGERPRINT_KEYS) and dp size
)
# What is trained, on what, for which loss; and the optimizer's hyperparameters, which its loaded
# state would silently put back (its lr excepted: keep_configured_lr)
RECORDED = ("data", "model", "adapter", "objective", "optimizer")
FINGERPRINT_KEYS = ("trainer.gradient_accumulation_steps",
                    "trainer.seed",  # the data order is a function of (seed, epoch)
                    "deepspeed.stage", "fsdp.name")  # the format of the model and optimizer files (trainloop.dcp)


def may_change_on_resume(key: str) -> bool:
    return key in MAY_CHANGE_ON_RESUME or key.partition(".")[0] in MAY_CHANGE_ON_RESUME


def run_fingerprint(cfg, world_size: int) -> dict:
    """What a checkpoint must agree with to be resumed exactly (the data's own content is added
    by Checkpointer.check_data once it is built): every key of RECORDED's sections but those that
    MAY_CHANGE_ON_RESUME, of the objective only those it reads (trainloop.objectives.keys_read)."""
    recorded = {f"{section}.{key}": value for section in RECORDED
                for key, value in OmegaConf.to_container(cfg[section], resolve=True).items()}
    read = keys_read(cfg)
    return {
        "world_size": world_size,
        **{key: OmegaConf.select(cfg, key) for key in FINGERPRINT_KEYS},
        **{key: value for key, value in recorded.items() if not may_change_on_resume(key)
           and (not key.startswith("objective.") or key in read)},
    }


def refuse_changes(path: Path, saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose fingerprint differs. A key the checkpoint lacks (saved before
    trainloop checked it) is not compared, and said so: old checkpoints stay resumable."""
    changed = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in current.items() if k in saved and saved[k] != v]
    if changed:
        raise ConfigError(f"checkpoint {path} was made with another config; changed: "
                          + "; ".join(changed) + ". Restore those settings to resume it, or "
                          "start a new run in a new hydra.run.dir")
    unknown = [k for k in current if k not in saved]
    if unknown:
        log.warning("checkpoint %s was saved before trainloop recorded %s: resuming it without "
                    "comparing those", path, ", ".join(unknown))


BATCH_KEYS = ("world_size", "data.batch_size", "trainer.gradient_accumulation_steps")
GLOBAL_BATCH = "global batch (world_size x data.batch_size x trainer.gradient_accumulation_steps)"


def global_batch(fingerprint: dict) -> int:
    world_size, batch_size, accumulation = (fingerprint[key] for key in BATCH_KEYS)
    return world_size * batch_size * accumulation


def describe_batch(fingerprint: dict) -> str:
    return (f"{fingerprint['world_size']} process(es) x data.batch_size={fingerprint['data.batch_size']} x "
            f"trainer.gradient_accumulation_steps={fingerprint['trainer.gradient_accumulation_steps']} = "
            f"{global_batch(fingerprint)} samples per step")


def how_to_keep_global_batch(saved: dict, current: dict) -> str:
    wanted, processes = global_batch(saved), current["world_size"]
    per_rank = current["trainer.gradient_accumulation_steps"] * processes
    if wanted % per_rank == 0:
        return f"resume with data.batch_size={wanted // per_rank} on {processes} process(es)"
    if wanted % processes == 0:
        return (f"resume on {processes} process(es) with data.batch_size x trainer.gradient_accumulation_steps "
                f"= {wanted // processes}")
    return f"resume on a number of processes that divides {wanted}"


def check_world_size_change(path: Path, saved: dict, current: dict, deepspeed_stage: int) -> None:
    """A run resumes at another world size under DDP and FSDP2 (whose checkpoints reshard on load)
    when the global batch is unchanged: the order of samples is global (trainloop.order), so it
    continues the same sequence. Not under ZeRO."""
    if not all(k in saved for k in BATCH_KEYS) or saved["world_size"] == current["world_size"]:
        return
    change = f"world_size: {saved['world_size']} -> {current['world_size']}"
    if deepspeed_stage:
        raise ConfigError(
            f"checkpoint {path} was saved by {saved['world_size']} processes, this run has "
            f"{current['world_size']} ({change}): under DeepSpeed ZeRO (deepspeed.stage={deepspeed_stage}) each "
            "rank saves its own partition of the optimizer state (and, at stage 3, of the parameters), "
            f"so the checkpoint resumes only on {saved['world_size']} processes; launch that many")
    if global_batch(saved) != global_batch(current):
        raise ConfigError(
            f"checkpoint {path} was saved with {describe_batch(saved)}; this run has {describe_batch(current)} "
            f"({change}). A run resumes at another world size only with the same global batch: "
            + how_to_keep_global_batch(saved, current))
    log.info("resuming %s at another world size (%s): the global batch of %d samples is unchanged",
             path, change, global_batch(current))


def describe_format(fsdp_name: str) -> str:
    if fsdp_name == "none":
        return "without FSDP (fsdp=none: accelerate's save_state, whole tensors or DeepSpeed's partitions)"
    return (f"under FSDP2 (fsdp={fsdp_name}: model and optimizer in torch.distributed.checkpoint format, "
            "a shard per rank)")


def check_format(path: Path, saved: dict, current: dict) -> None:
    """A checkpoint saved under FSDP2 holds DCP shards, any other holds accelerate's files: neither
    loads into the other. A checkpoint from before FSDP2 (no fsdp.name recorded) was saved without it."""
    saved_fsdp, fsdp = saved.get("fsdp.name", "none"), current["fsdp.name"]
    if saved_fsdp != fsdp:
        raise ConfigError(
            f"checkpoint {path} was saved {describe_format(saved_fsdp)}; this run is {describe_format(fsdp)} "
            f"and cannot load it (fsdp.name: {saved_fsdp!r} -> {fsdp!r}). Resume it with fsdp={saved_fsdp}, "
            "or start a new run in a new hydra.run.dir")


def step_of(path: Path) -> int:
    return int(path.name.rpartition("_")[2])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        _fsync(path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(TMP_PREFIX + path.name)
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


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
    return integrity.damaged(path, saved.get(integrity.KEY, {}))


def file_sizes(root: Path) -> dict:
    return {str(f.relative_to(root)): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}


def no_space_left(err: BaseException, where: Path, needed: int) -> bool:
    """ENOSPC anywhere in the chain; torch's zip writer reports a short write without errno
    ("unexpected pos"), so a disk with less free space than a checkpoint takes counts too."""
    cause = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
        cause = cause.__cause__ or cause.__context__
    return shutil.disk_usage(where).free < max(needed, 1 << 20)


def parameters_finite(accelerator, model) -> bool:
    """True when every rank's parameters (its ZeRO-3 partition, if any) are all finite."""
    import torch

    bad = torch.zeros((), device=accelerator.device)
    for p in model.parameters():
        local = local_shard(p)
        if local.numel():
            bad += (~torch.isfinite(local.detach())).any().float()
    return accelerator.reduce(bad, reduction="sum").item() == 0


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
        self.async_save = strategy.saves_async and cfg.checkpoint.async_save  # DCP (trainloop.dcp) writes in the background
        self.in_flight = None  # the asynchronous save being written (trainloop.dcp.InFlight)
        self.unsettled: tuple[Path, Path] | None = None  # (tmp, final) of the last one, until all ranks agree it
        self.steps_done = 0  # the optimizer steps training has taken, as poll last heard
        self._group = None  # the process group asynchronous saves talk over, made at the first one
        self._committed: list[dict] = []  # asynchronous saves committed since poll last returned

    def record_config(self, recorded) -> None:
        """Once the run is built: the config its saves record, the batch it takes included (one
        trainer.auto_batch_size settled: trainloop.batch_size.with_batch)."""
        self.recorded = recorded

    @property
    def fingerprint(self) -> dict:
        """What this run's saves record, from the config as the run applied it (a batch size
        settled by trainer.auto_batch_size included), and the data's own fingerprint."""
        return {**run_fingerprint(self.recorded, self.strategy.dp_size), **self.data_fingerprint}

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step_*") if (p / COMPLETE).is_file()), key=step_of)

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
        if self.async_save:
            self._agree_saved(self._attempt(self._start_async, tmp, final, state, model), tmp, final)
            log.info("saving checkpoint %s in the background after step %d; training goes on", final, state.step)
            return final
        self._agree_saved(self._attempt(self._save_state, tmp, model), tmp, final)
        # every rank's files are written (and closed) from here on
        failure = (self._attempt(self._commit, tmp, final, state.state_dict(), self.fingerprint)
                   if acc.is_main_process else None)
        self._agree_saved(failure, tmp, final)
        return final

    def _start_async(self, tmp: Path, final: Path, state, model) -> None:
        from trainloop import dcp

        dcp.save_rank_states(self.accelerator, tmp)  # small: written now
        integrity.record_rank_files(tmp, self.accelerator.process_index)
        if self._group is None:
            self._group = dcp.checkpoint_group(self.cfg.trainer.collective_timeout_s)
        self.unsettled = (tmp, final)
        self.in_flight = dcp.start_async(tmp, final, model, self.accelerator._optimizers[0], self.adapter_only,
                                         state.state_dict(), self.fingerprint, self._group,
                                         lambda: self.steps_done)

    def poll(self, step: int) -> list[dict]:
        """Every optimizer step, on every rank: finish an asynchronous save whose shards are all
        written (the main process commits it: rank 0's future is done only then); return the
        records of the saves committed since the last call, for metrics.jsonl (main process)."""
        self.steps_done = step
        if self.in_flight is not None and self.in_flight.future.done():
            save = self.in_flight
            failure = self._finish_in_flight()
            if failure is not None:  # DCP reports a rank's failure to every rank: each stops here
                self._raise_save_failure(failure, save.tmp, save.final)
        committed, self._committed = self._committed, []
        return committed

    def wait(self, step: int) -> list[dict]:
        """Every rank, at the end of training (and at a preemption's stop, after its save): wait
        for the save in flight, commit it, and agree that it is committed."""
        self.steps_done = step
        self._settle()
        return self.poll(step)

    def _settle(self) -> None:
        """Every rank, together: finish the last asynchronous save (if this rank has not in poll)
        and agree on its outcome, so that no rank goes on (or names the last good checkpoint)
        before the main process has committed it."""
        if self.unsettled is None:
            return
        (tmp, final), self.unsettled = self.unsettled, None
        self._agree_saved(self._finish_in_flight(), tmp, final)

    def _raise_save_failure(self, failure: BaseException, tmp: Path, final: Path):
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise self._save_error(failure, tmp, final) from failure

    def _finish_in_flight(self) -> BaseException | None:
        """This rank's part of the save in flight: wait until its shards are written; the main
        process then commits the folder. The failure, if any, is returned."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return None
        acc = self.accelerator
        waited = time.monotonic()
        try:
            save.future.result()
            waited = time.monotonic() - waited
            if acc.is_main_process:
                self._commit(save.tmp, save.final, save.state, save.fingerprint)
        except Exception as err:  # this rank's, or another's: DCP reports a failed write to every rank
            return err
        if not acc.is_main_process:
            return None
        # the callback that records these may still be running in the writing thread
        written_by = save.written_by_step[0] if save.written_by_step else self.steps_done
        write_s = (save.written_at[0] if save.written_at else time.monotonic()) - save.started
        # blocked_s < write_s: the save handed training back before its shards were written
        record = {"step": self.steps_done, "event": "checkpoint", "checkpoint": save.final.name,
                  "saved_step": save.step, "written_by_step": written_by, "committed_at_step": self.steps_done,
                  "write_s": round(write_s, 3), "blocked_s": round(save.blocked_s, 3), "waited_s": round(waited, 3)}
        self._committed.append(record)
        log.info("committed checkpoint %s: saved after step %d (training held for %.2f s), written in %.2f s "
                 "in the background (training had taken %d steps by then); training waited %.2f s more for it",
                 save.final.name, save.step, save.blocked_s, write_s, written_by, waited)
        return None

    @property
    def adapter_only(self) -> bool:
        """With an adapter, checkpoints hold the trainable parameters only: the frozen base is
        rebuilt from its source (model.name_or_path, or the seeded init) at every start."""
        return self.cfg.adapter.name != "none"

    def _save_state(self, directory: Path, model) -> None:
        self.strategy.save_state(directory, model, self.adapter_only)
        integrity.record_rank_files(directory, self.accelerator.process_index)

    def _load_state(self, path: Path, model) -> None:
        self.strategy.load_state(path, model, self.adapter_only)

    @staticmethod
    def _attempt(action, *args) -> BaseException | None:
        try:
            action(*args)
        except Exception as err:  # any failure: every rank must hear of it (_agree_saved)
            return err
        return None

    def _agree_saved(self, failure: BaseException | None, tmp: Path, final: Path) -> None:
        """A barrier that also tells every rank whether any rank failed to write its part, so
        none waits forever for a rank that failed; each then stops with the message."""
        import torch

        acc = self.accelerator
        failed = torch.tensor(float(failure is not None), device=acc.device)
        if acc.reduce(failed, reduction="sum").item() == 0:
            return
        error = self._save_error(failure, tmp, final)
        if acc.is_main_process:
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
        """Main process: config, checksums, trainer state, COMPLETE, fsync, rename into place, retention."""
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.recorded, resolve=True))
        checksums = integrity.gather(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(
            {"state": state, "fingerprint": fingerprint, "max_steps": self.cfg.trainer.max_steps,
             "files": file_sizes(tmp), integrity.KEY: checksums}, indent=2))
        (tmp / COMPLETE).write_text("")
        _fsync_tree(tmp)
        if final.exists():  # another history's (find_resume refuses that) or a user's copy
            log.warning("replacing %s", final)
            shutil.rmtree(final.rename(self.root / f"{TMP_PREFIX}removing_{final.name}"))
        os.replace(tmp, final)
        _fsync(self.root)  # the rename itself is durable only once the folder is synced
        _write_atomic(self.root / "latest", final.name)
        for old in self.complete()[:-self.keep_last]:
            doomed = old.rename(self.root / f"{TMP_PREFIX}removing_{old.name}")  # never half a checkpoint
            shutil.rmtree(doomed)
        log.info("saved checkpoint %s", final)

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
        if integrity.KEY not in saved:  # refusing would strand every run saved before them
            log.warning("checkpoint %s was saved before trainloop recorded checksums: its files are checked "
                        "by size and format only", path)
        check_format(path, saved["fingerprint"], self.fingerprint)
        check_world_size_change(path, saved["fingerprint"], self.fingerprint, self.cfg.deepspeed.stage)
        refuse_changes(path, *self._comparable(saved["fingerprint"], self.fingerprint))
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

    def _comparable(self, saved: dict, current: dict) -> tuple[dict, dict]:
        """Under DDP, when the global batch agrees, its split into processes, micro-batch and
        accumulation may change (trainloop.order: the same samples per step); otherwise each part
        is compared, as under ZeRO (where check_world_size_change has refused another world size)."""
        if (not self.cfg.deepspeed.stage and all(k in f for f in (saved, current) for k in BATCH_KEYS)
                and global_batch(saved) == global_batch(current)):
            return tuple({k: v for k, v in f.items() if k not in BATCH_KEYS} | {GLOBAL_BATCH: global_batch(f)}
                         for f in (saved, current))
        return self._per_device(saved), self._per_device(current)

    def _per_device(self, fingerprint: dict) -> dict:
        """With trainer.auto_batch_size the run settles batch x accumulation itself (a resume
        takes the checkpoint's): only their product, the per-device batch, must agree."""
        batch_keys = ("data.batch_size", "trainer.gradient_accumulation_steps")
        if not self.cfg.trainer.auto_batch_size or not all(k in fingerprint for k in batch_keys):
            return fingerprint
        comparable = {k: v for k, v in fingerprint.items() if k not in batch_keys}
        comparable["data.batch_size x trainer.gradient_accumulation_steps"] = \
            fingerprint[batch_keys[0]] * fingerprint[batch_keys[1]]
        return comparable

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
        state.load_state_dict(read_state(path)["state"])
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

