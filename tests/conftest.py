"""Shared fixtures: compose the REAL config from conf/, shrink it, and run it for real.

- `compose(*overrides)`: the composed DictConfig, as `python -m trainloop OVERRIDES` would see it.
- `train(tmp_path, *overrides)`: one in-process run of trainloop.run.run; returns the run dir.
- `launch(args, ...)`: a subprocess (python -m trainloop, torchrun, accelerate, deepspeed)
  with a clean environment; returns the CompletedProcess.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainloop.config import compose_config

# Every test run is shrunk to this: a 2-layer, 64-wide model, 64-token blocks, a few steps.
SMALL = ["+preset=smoke", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2",
         "trainer.eval_batches=2", "logging.progress_bar=false"]

REPO = Path(__file__).resolve().parent.parent

# DeepSpeed JIT-compiles its CPU ops into TORCH_EXTENSIONS_DIR under a hash that includes this
# venv's include paths: two venvs sharing ~/.cache/torch_extensions rebuild each other's ops
# (and wait on each other's build lock). One cache per venv: each builds once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def compose(*overrides: str):
    """The composed config, unchecked: tests also compose configs that validate() must refuse."""
    return compose_config(overrides, check=False)


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; a new in-process run needs them cleared."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train(run_dir: Path, *overrides: str, small: bool = True):
    """Run trainloop in this process with SMALL + overrides; returns the run dir."""
    from trainloop.run import run

    reset_accelerate()
    cfg = compose(*(SMALL if small else []), *overrides)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run(cfg, run_dir=run_dir)
    return run_dir


@pytest.fixture(autouse=True)
def distributed_left_as_found():
    """Every test leaves torch.distributed and the rank variables as it found them, as run() does: a
    test that builds a DeepSpeed or FSDP2 accelerator itself (tests/test_deepspeed_config.py) left
    LOCAL_RANK behind, which makes the next 1-process run on that worker a DDP group of one."""
    from trainloop.accelerator import distributed_as_found

    with distributed_as_found():
        yield


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def clean_env(**extra: str) -> dict:
    """The environment for a child process: offline, quiet, 1 thread per rank (2 cores here),
    and every Python process prints all its threads' stacks on SIGABRT (see `end_family`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "PYTEST_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


def family(pid: int) -> list[int]:
    """pid and its descendants: torchrun starts each rank in a session of its own, so the
    launcher's process group does not hold the ranks or their DataLoader workers."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [p for child in (task / "children").read_text().split() for p in family(int(child))]
        except OSError:  # it exited meanwhile
            pass
    return found


def end_family(proc: subprocess.Popen, stacks: bool) -> None:
    """Kill a launch that ran past its time and everything it started; with `stacks`, first
    SIGABRT, on which each Python process of it (PYTHONFAULTHANDLER) prints its threads' stacks."""
    pids = family(proc.pid)
    for sig in (signal.SIGABRT, signal.SIGKILL) if stacks else (signal.SIGKILL,):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGABRT:
            time.sleep(5)


def launch(args: list[str], cwd: Path | None = None, timeout: float = 600, check: bool = True,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command (args[0] 'python' means this interpreter); fail with its output if check.
    Past the timeout it fails with every process's stacks (a hang says where it hangs)."""
    if args[0] == "python":
        args = [sys.executable, *args[1:]]
    elif args[0] in ("torchrun", "accelerate", "deepspeed"):
        args = [str(Path(sys.executable).parent / args[0]), *args[1:]]
    proc = subprocess.Popen(args, cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_family(proc, stacks=True)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(args)} ran past {timeout} s; the stacks of its processes:\n--- stdout\n"
                    f"{stdout[-6000:]}\n--- stderr\n{stderr[-20000:]}")
    done = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
                    f"\n--- stderr\n{done.stderr[-6000:]}")
    return done


@pytest.fixture
def tiny_jsonl(tmp_path: Path) -> Path:
    """A local jsonl dataset (field 'content') cut from Python's own documentation text."""
    from pydoc_data.topics import topics

    path = tmp_path / "corpus.jsonl"
    with path.open("w") as f:
        for key in sorted(topics)[:40]:
            f.write(json.dumps({"content": topics[key], "id": key}) + "\n")
    return path


@pytest.fixture
def local_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer directory on disk, as a user would bring one."""
    from trainloop.data import byte_level_tokenizer

    path = tmp_path / "tokenizer"
    byte_level_tokenizer().save_pretrained(path)
    return path


# --- DeepSpeed's compiled ops -------------------------------------------------------------------
# DeepSpeed JIT-compiles its CPU ops (shm_comm, cpu_adam, async_io) on first use: 8 to 15 minutes
# of compiler time on a fresh 2-core machine, most of it async_io. So the build starts in the
# background, at the lowest CPU priority, as soon as the collected tests include one that needs
# it, and those tests run last: the rest of the suite runs meanwhile, and the compiler takes the
# core that single-threaded test subprocesses leave idle. The build is left to finish if the
# session ends first (`-x`): killing it would leave a stale lock that blocks the next build.
OPS_FIXTURE = "deepspeed_ops"
OPS_LOG = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "trainloop-build.log"
OPS_BUILD_WAIT_S = 1800
_ops_build: subprocess.Popen | None = None


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core, at most 4: many tests start 2-process runs of their own."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(session, config, items):
    global _ops_build
    position = {id(item): i for i, item in enumerate(items)}
    # Under xdist each worker collects the same sorted list and the load scheduler hands tests
    # out in that order, so the DeepSpeed tests still come last.
    items.sort(key=lambda item: (OPS_FIXTURE in item.fixturenames, position[id(item)]))
    timeouts = config.pluginmanager.hasplugin("timeout")  # absent under `-p no:timeout`
    for item in items:  # the first of them may wait for the build: pytest-timeout's limit counts it
        if timeouts and OPS_FIXTURE in item.fixturenames:
            item.add_marker(pytest.mark.timeout(OPS_BUILD_WAIT_S + float(config.getini("timeout"))))
    if config.option.collectonly or not any(OPS_FIXTURE in item.fixturenames for item in items):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # one build for the session: other workers' fixtures wait on its lock, then find it built
    OPS_LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(OPS_LOG, "w") as log:
        _ops_build = subprocess.Popen([sys.executable, "-m", "trainloop.deepspeed"],
                                      env=clean_env(DS_ACCELERATOR="cpu"), stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=lambda: os.nice(19), start_new_session=True)


@pytest.fixture(scope="session")
def deepspeed_ops() -> None:
    """DeepSpeed's CPU ops, built (or found built) by the background build started at collection."""
    if _ops_build is None:  # e.g. the fixture requested indirectly: build in the foreground
        launch(["python", "-m", "trainloop.deepspeed"], timeout=OPS_BUILD_WAIT_S, env=clean_env(DS_ACCELERATOR="cpu"))
        return
    started = time.monotonic()
    code = _ops_build.wait(timeout=OPS_BUILD_WAIT_S)
    waited = time.monotonic() - started
    if code != 0:
        pytest.fail(f"python -m trainloop.deepspeed exited {code}:\n{OPS_LOG.read_text()[-6000:]}")
    print(f"waited {waited:.0f} s for DeepSpeed's ops: {OPS_LOG.read_text().strip().splitlines()[-1]}")


# --- The per-test time-out ------------------------------------------------------------------------
# pytest-timeout sets the limit (pyproject.toml's `timeout`, @pytest.mark.timeout); faulthandler's
# watchdog keeps it. It is a C thread, so a hang in C code that holds the GIL (gloo's destructor,
# once) still ends; it writes every thread's stack to the real stderr, which xdist shows (pytest-
# timeout's own dump goes to a worker's terminal, which xdist drops); and it ends the worker: xdist
# reports that test as crashed, starts another, and the suite goes on.
_stderr: int | None = None


def pytest_configure(config):
    global _stderr
    _stderr = os.dup(2)  # output capture is off here; during a test fd 2 is pytest's capture file


def pytest_timeout_set_timer(item, settings):
    faulthandler.dump_traceback_later(settings.timeout, exit=True, file=_stderr)
    return True


def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()
    return True
