"""Starting a run: plain `python -m trainloop` with DeepSpeed presets (one process, no launcher),
a launcher that started fewer processes than asked, DeepSpeed's one-time op builds and its
start-up noise, and a DeepSpeed setting that cannot work, said before anything is built."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from helpers import compose, launch

QUICK = ["trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_batches=1",
         "logging.progress_bar=false"]


@pytest.mark.slow
@pytest.mark.parametrize("preset, engaged", [
    ("zero3_offload", "DeepSpeed ZeRO-3 engaged with optimizer offload to cpu and parameter offload to cpu"),
    ("zero2", "DeepSpeed ZeRO-2 engaged"),
])
def test_plain_python_runs_a_deepspeed_preset_as_one_process(preset, engaged, tmp_path, deepspeed_ops):
    """No launcher, so no RANK/WORLD_SIZE/MASTER_*: trainloop makes a 1-process group itself, as
    HF Trainer users run --deepspeed on one GPU. What DeepSpeed prints on every load stays off."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    proc = launch(["python", "-m", "trainloop", f"+preset=[smoke,{preset}]", *QUICK, f"hydra.run.dir={run_dir}"],
                  cwd=tmp_path)
    assert f"{engaged} (DistributedType.DEEPSPEED, 1 process(es)" in (run_dir / "train.log").read_text()
    output = proc.stdout + proc.stderr
    assert "built successfully" not in output  # DeepSpeed's notice on each load of its CPU collectives
    assert "-laio" not in output  # DeepSpeed's libaio probe, one gcc line per call
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_accelerate_launch_that_started_one_process_of_two_says_what_to_type(tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("with 2 GPUs accelerate launch starts 2 processes without --multi_gpu")
    proc = launch(["accelerate", "launch", "--num_processes", "2", "-m", "trainloop",
                   "+preset=[smoke,zero3_offload]", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert ("trainloop: error: `accelerate launch --num_processes 2` started one process, not 2" in proc.stderr), \
        proc.stderr[-3000:]
    assert "`accelerate launch --multi_gpu --num_processes 2 -m trainloop ...`" in proc.stderr
    assert "Default process group has not been initialized" not in proc.stderr


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Path:
    """An existing folder this process cannot write in (root ignores permissions: then /sys)."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK) and os.geteuid() != 0:
        yield folder
    elif Path("/sys").is_dir() and not _can_write_in(Path("/sys")):
        yield Path("/sys")
    else:
        pytest.skip("no read-only folder available to this user")
    folder.chmod(0o755)


def _can_write_in(folder: Path) -> bool:
    try:
        (folder / ".trainloop_probe").touch()
    except OSError:
        return False
    (folder / ".trainloop_probe").unlink()
    return True


def test_read_only_nvme_path_is_one_line_before_anything_is_built(tmp_path, read_only_dir):
    proc = launch(["python", "-m", "trainloop", "+preset=[smoke,zero3_nvme]",
                   f"deepspeed.nvme_path={read_only_dir}", *QUICK, f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert len(errors) == 1 and f"deepspeed.nvme_path={read_only_dir}: cannot write files in it" in errors[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_first_use_op_build_is_announced_with_its_cache_folder(tmp_path, monkeypatch, caplog):
    """An empty extensions folder: DeepSpeed would compile; the log says what, and where it goes."""
    from trainloop.parallel.deepspeed_config import announce_op_builds

    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (extensions / "cpu_adam").mkdir(parents=True)
    (extensions / "cpu_adam" / "lock").touch()  # as another process's build in progress leaves it
    caplog.set_level(logging.INFO, logger="trainloop")
    announce_op_builds(compose("+preset=[smoke,zero3_offload]"), on_cuda=False)
    said = caplog.text
    assert "DeepSpeed compiles its cpu_adam op (the CPU Adam of optimizer offload) in this run: one time" in said
    assert f"cached in {extensions / 'cpu_adam'}" in said
    assert "compiles its deepspeed_shm_comm op" in said
    lock = extensions / "cpu_adam" / "lock"
    assert f"another process is building cpu_adam already: waiting for its lock {lock}" in said
    assert "async_io" not in said  # no NVMe offload here


def test_built_ops_are_not_announced(caplog, deepspeed_ops, monkeypatch):
    from trainloop.parallel.deepspeed_config import announce_op_builds

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    caplog.set_level(logging.INFO, logger="trainloop")
    announce_op_builds(compose("+preset=[smoke,zero3_offload]"), on_cuda=False)
    assert "DeepSpeed compiles" not in caplog.text
