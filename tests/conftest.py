"""The suite's fixtures and hooks: the environment every test starts from, what the suite makes once
(distill's teacher), DeepSpeed's compiled ops (built once, in the background), the per-test
time-out, each xdist worker's threads and its warm ranks (closed at the end, none left). What tests
share besides fixtures (compose, train, launch, warm, ...) is in helpers.py."""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import TEACHER, clean_env, close_warm_pool, launch, make_teacher, teacher_dir

# DeepSpeed JIT-compiles its CPU ops into TORCH_EXTENSIONS_DIR under a hash that includes this
# venv's include paths: two venvs sharing ~/.cache/torch_extensions rebuild each other's ops
# (and wait on each other's build lock). One cache per venv: each builds once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(autouse=True)
def distributed_left_as_found():
    """Every test leaves torch.distributed and the rank variables as it found them, as run() does: a
    test that builds a DeepSpeed or FSDP2 accelerator itself (tests/test_deepspeed_config.py) left
    LOCAL_RANK behind, which makes the next 1-process run on that worker a DDP group of one."""
    from trainloop.parallel.process_group import distributed_as_found

    with distributed_as_found():
        yield


@pytest.fixture(autouse=True)
def stop_signals_left_as_found():
    """A run preempted in this process ignores SIGTERM and SIGUSR1 from then on (trainloop.preemption): the
    next test on the worker, and what it starts (an ignored signal lasts through exec), must not inherit it."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def teacher(request) -> Path | None:
    """helpers.TEACHER, made once for the whole suite run (by whichever worker comes first); not for a
    pytest of files elsewhere that loads this conftest as a plugin (tests/test_timeout.py)."""
    here = Path(__file__).parent
    if not any(here in Path(item.path).parents for item in request.session.items):
        return None
    return make_teacher()


def pytest_sessionfinish(session, exitstatus):
    """A worker's warm ranks end with it, and nothing they started outlives them."""
    left = close_warm_pool()
    if left:
        os.write(_stderr or 2, f"warm ranks: processes {left} were alive after the pool closed (now killed)\n".encode())
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    """The controller (or the only process) removes what the suite made once for all its workers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    workers = getattr(config.option, "testrunuid", None)  # the workers' suite id; under -n 0 this process's
    for made in {TEACHER, *([teacher_dir(workers)] if workers else [])}:
        shutil.rmtree(made, ignore_errors=True)
        Path(f"{made}.lock").unlink(missing_ok=True)


@pytest.fixture
def child_env(monkeypatch):
    """Runs started with this process's environment (verify_resume's) get a clean one."""
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)


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
    from trainloop.data.loaders import byte_level_tokenizer

    path = tmp_path / "tokenizer"
    byte_level_tokenizer().save_pretrained(path)
    return path


# --- DeepSpeed's compiled ops -------------------------------------------------------------------
# DeepSpeed JIT-compiles its CPU ops (shm_comm, cpu_adam, async_io) on first use: 8 to 15 minutes
# of compiler time on a fresh 2-core machine, most of it async_io; about 10 s where ccache holds them
# from another venv (trainloop.deepspeed compiles through it: compiler_cache). So the build starts in the
# background, at the lowest CPU priority, as soon as the collected tests include one that needs
# it, and those tests run after the modules of slow tests (pytest_collection_modifyitems): the rest runs
# meanwhile, and the compiler takes the core that single-threaded test subprocesses leave idle. The build is left to finish if the
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
    # Under xdist each worker collects the same sorted list and the load scheduler hands tests out in that
    # order: the modules that hold slow tests first, whole (a module's fixtures are made once per worker), then
    # the tests that use DeepSpeed's ops (the build started below has had the others' time to finish), then the
    # modules of quick tests alone, which even out the workers' ends: a long test handed out last would leave
    # the other worker's core idle until it ended.
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (1 if OPS_FIXTURE in item.fixturenames else 0 if item.module in slow else 2,
                                 position[id(item)]))
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
    # the controller names the run before xdist starts its workers, so that it knows what they share
    if hasattr(config.option, "testrunuid") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex
    # An xdist worker's in-process runs compute on the worker's share of the cores, as each launched
    # rank does on one (clean_env): with torch's default, a thread per core in every worker, the
    # threads spin waiting on each other (2 cores, 2 workers: test_efficiency, test_grpo,
    # test_checkpoint and test_activation_offload took 176 s; 146 s with one thread each).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set before the conftest loads
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_timeout_set_timer(item, settings):
    faulthandler.dump_traceback_later(settings.timeout, exit=True, file=_stderr)
    return True


def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()
    return True
