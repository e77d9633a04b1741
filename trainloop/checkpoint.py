"""Checkpoints: atomic saves under RUN_DIR/checkpoints/step_NNNNNNN, resume, retention.

A save is written to a temporary folder by every rank (accelerate's save_state: model,
optimizer, scheduler, scaler, RNG states, sampler), completed with the trainer state and the
config, synced to disk, marked COMPLETE, renamed into place, and only then named in `latest`.
A folder without COMPLETE is never loaded, and older checkpoints are removed only after that.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from trainloop.config import ConfigError

log = logging.getLogger("trainloop")

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"


def run_fingerprint(cfg, world_size: int) -> dict:
    """What a checkpoint must agree with to be resumed exactly."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for key in ("attn_implementation", "gradient_checkpointing"):  # do not change the weights
        model.pop(key)
    return {
        "world_size": world_size,
        "trainer.gradient_accumulation_steps": cfg.trainer.gradient_accumulation_steps,
        "data.batch_size": cfg.data.batch_size,
        "data.seq_len": cfg.data.seq_len,
        "deepspeed.stage": cfg.deepspeed.stage,
        "model": model,
    }


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True) + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    def __init__(self, cfg, accelerator, run_dir: Path):
        self.cfg = cfg
        self.every = cfg.checkpoint.every_steps
        self.keep_last = cfg.checkpoint.keep_last
        self.accelerator = accelerator
        self.root = Path(run_dir) / "checkpoints"
        self.fingerprint = run_fingerprint(cfg, accelerator.num_processes)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).is_file())

    def save(self, state) -> Path:
        acc = self.accelerator
        final = self.root / f"step_{state.step:07d}"
        if (final / COMPLETE).is_file():
            return final
        tmp = self.root / f".tmp_step_{state.step:07d}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            (tmp / STATE_FILE).write_text(json.dumps(
                {"state": state.state_dict(), "fingerprint": self.fingerprint}, indent=2))
            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
            (tmp / COMPLETE).write_text("")
            _fsync_tree(tmp)
            os.replace(tmp, final)
            _write_atomic(self.root / "latest", final.name)
            for old in self.complete()[:-self.keep_last]:
                shutil.rmtree(old)
            log.info("saved checkpoint %s", final)
        acc.wait_for_everyone()
        return final

    def find_resume(self) -> Path | None:
        """The checkpoint checkpoint.resume names, checked against this run's config."""
        spec = self.cfg.checkpoint.resume
        if spec is None:
            return None
        if spec == "auto":
            found = self.complete()
            if not found:
                log.info("checkpoint.resume=auto: no complete checkpoint in %s; starting fresh", self.root)
                return None
            path = found[-1]
        else:
            path = Path(spec).expanduser()
            if not (path / COMPLETE).is_file():
                raise ConfigError(f"checkpoint.resume={spec!r} is not a complete checkpoint "
                                  f"(no {COMPLETE} marker); give a checkpoints/step_NNNNNNN folder")
        saved = json.loads((path / STATE_FILE).read_text())["fingerprint"]
        changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in self.fingerprint.items() if saved.get(k) != v]
        if changed:
            raise ConfigError(f"checkpoint {path} was made with another config; changed: "
                              + "; ".join(changed) + ". Restore those settings, or start a new run "
                              "without checkpoint.resume")
        return path

    def load(self, path: Path, state) -> None:
        self.accelerator.load_state(str(path))
        state.load_state_dict(json.loads((path / STATE_FILE).read_text())["state"])
        log.info("resumed from %s at step %d", path, state.step)
