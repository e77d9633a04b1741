"""What the tests share: compose the REAL config from conf/, run it for real (in this process, or
as a user launches it), and read what a run left. Fixtures live in conftest.py; everything a test
module imports from another lives here.

- `compose(*overrides)`: the composed DictConfig, as `python -m trainloop OVERRIDES` would see it.
- `train(run_dir, *overrides)`: one in-process run of trainloop.run.run; returns the run dir.
- `launch(args, ...)`: a subprocess (python -m trainloop, torchrun, accelerate, deepspeed) with a
  clean environment; returns the CompletedProcess. `start`/`finish`: the same in the background.
- `torchrun(n)`, `accelerate_launch(n)`: the launchers' command lines for n processes on a free port.
- `warm(n, args, ...)`: `python -m trainloop ARGS` on n warm ranks (tests/warm_ranks.py): the launcher's
  environment without a launcher's imports; what multi-process runs that test numbers use.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# MLflow's client, which scripts/setup.sh installs beside the venv (pyproject.toml's test extra says why): on the
# path of the pytest workers, where tests/test_trackers.py runs it, before accelerate reads what is installed.
# A child process that logs to MLflow gets it with clean_env(PYTHONPATH=str(MLFLOW)).
MLFLOW = Path(sys.prefix) / "mlflow"
if MLFLOW.is_dir() and str(MLFLOW) not in sys.path:
    sys.path.append(str(MLFLOW))

import pytest  # noqa: E402
import torch  # noqa: E402

from trainloop.config.compose import CONFIG_DIR, compose_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"

# Every test run is shrunk to this: a 2-layer, 64-wide model, 64-token blocks, a few steps.
SMALL = ["+preset=smoke", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2",
         "trainer.eval_batches=2", "logging.progress_bar=false"]

# 2 processes at batch 4 against 1 at batch 8 (tests/test_distributed.py, test_fsdp.py): the run and
# how close the losses must come.
TWO_PROCESS_STEPS = 10
TWO_PROCESS_RUN = [f"trainer.max_steps={TWO_PROCESS_STEPS}", "trainer.log_every=1",
                   f"trainer.eval_every={TWO_PROCESS_STEPS}", "trainer.eval_batches=1", "logging.progress_bar=false",
                   "checkpoint.keep_last=1"]
DDP_TOLERANCE = 1e-5
ZERO_TOLERANCE = 1e-3


# --- Configs --------------------------------------------------------------------------------------
GROUPS = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name not in ("preset", "__pycache__"))
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONFIG_DIR / g).glob("*.yaml"))]
NEEDS = {  # options whose required keys the user must give
    ("model", "hf"): ["model.name_or_path=/some/model"],
    ("data", "files"): ["data.path=/some/data.jsonl"],
    ("data", "chat"): ["data.path=/some/chats.jsonl"],
    ("data", "vision_chat"): ["data.path=/some/chats.jsonl", "model.arch=llava"],
    ("data", "prompt_completion"): ["data.path=/some/pairs.jsonl"],
    ("data", "prepared"): ["data.path=/some/prepared"],
    ("data", "preference"): ["data.path=/some/pairs.jsonl", "objective=dpo", "adapter=lora"],
    ("objective", "dpo"): ["data=preference", "data.path=/some/pairs.jsonl", "adapter=lora"],
    ("objective", "simpo"): ["data=preference", "data.path=/some/pairs.jsonl"],
    ("objective", "orpo"): ["data=preference", "data.path=/some/pairs.jsonl"],
    ("objective", "reward"): ["data=preference", "data.path=/some/pairs.jsonl"],
    ("objective", "kto"): ["data=unpaired", "data.path=/some/rows.jsonl", "adapter=lora"],
    ("data", "unpaired"): ["data.path=/some/rows.jsonl", "objective=kto", "adapter=lora"],
    ("data", "prompts"): ["data.path=/some/prompts.jsonl", "objective=grpo",
                          "objective.rewards=[trainloop.objectives.rewards:exact_answer]"],
    ("objective", "grpo"): ["data=prompts", "data.path=/some/prompts.jsonl",
                            "objective.rewards=[trainloop.objectives.rewards:exact_answer]"],
}


def suite_id() -> str:
    """The same in every xdist worker of one `pytest` (and its controller, tests/conftest.py)."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"


def teacher_dir(suite: str) -> Path:
    return Path(tempfile.gettempdir()) / f"trainloop-teacher-{suite}"


# A teacher for objective=distill's table-wide tests: a random 4-layer Llama at the tiny models'
# vocabulary, with the built-in tokenizer. Its path is known at import (tests name it in their
# parameters); it is made once per suite run, by make_teacher (tests/conftest.py, before any test).
TEACHER = teacher_dir(suite_id())


def script(name: str):
    """scripts/NAME.py loaded as a module (scripts/ is no package): what its tests call of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_teacher() -> Path:
    """TEACHER, made by the first worker that gets here; the others wait on its lock and find it."""
    import fcntl
    import shutil

    matrix = script("matrix")
    TEACHER.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{TEACHER}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (TEACHER / "config.json").is_file():
            return TEACHER
        making = matrix.write_teacher(Path(tempfile.mkdtemp(prefix=f"{TEACHER.name}-", dir=TEACHER.parent)))
        shutil.rmtree(TEACHER, ignore_errors=True)
        making.rename(TEACHER)
    return TEACHER


NEEDS[("objective", "distill")] = [f"objective.teacher={TEACHER}"]
# What each objective trains on, on top of the smoke preset, with the repository's test data (a new
# row adds its own).
OBJECTIVE_NEEDS = {
    "causal_lm": [],
    "dpo": ["data=preference", f"data.path={DATA / 'preference.jsonl'}", "adapter=lora", "optimizer.lr=1e-2"],
    "simpo": ["data=preference", f"data.path={DATA / 'preference.jsonl'}"],
    "orpo": ["data=preference", f"data.path={DATA / 'preference.jsonl'}"],
    "reward": ["data=preference", f"data.path={DATA / 'preference.jsonl'}"],
    "kto": ["data=unpaired", f"data.path={DATA / 'unpaired.jsonl'}", "adapter=lora", "optimizer.lr=1e-2"],
    "distill": [f"objective.teacher={TEACHER}"],
    "grpo": ["data=prompts", f"data.path={DATA / 'prompts.jsonl'}", "optimizer.lr=1e-2",
             f"objective.rewards=[{DATA / 'grpo_rewards.py'}:letters]", "objective.num_generations=4",
             "objective.max_new_tokens=6", "data.validation_fraction=0.2"]}


def compose(*overrides: str):
    """The composed config, unchecked: tests also compose configs that validate() must refuse."""
    return compose_config(overrides, check=False)


# --- Runs in this process -------------------------------------------------------------------------
def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; a new in-process run needs them cleared."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def started(objective, cfg, model):
    """The objective as the build hands it over on one process, with the frozen model it keeps (a reference,
    distill's teacher) placed by the one-process strategy."""
    from accelerate import Accelerator

    from trainloop.parallel import build_strategy

    frozen = objective.frozen_copy(model)
    if frozen is not None:
        reset_accelerate()
        strategy = build_strategy(cfg, Accelerator(cpu=True))
        objective.start(strategy, model, strategy.prepare_frozen(frozen), None, None, None)
    return objective


def train(run_dir: Path, *overrides: str, small: bool = True):
    """Run trainloop in this process with SMALL + overrides; returns the run dir."""
    from trainloop.run import run

    reset_accelerate()
    cfg = compose(*(SMALL if small else []), *overrides)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run(cfg, run_dir=run_dir)
    return run_dir


def once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """`make(path)` run once per suite run, whichever xdist worker asks first (the others wait on its
    lock, then find it made), into a directory all workers share; returns the path. A reference
    several tests or modules compare against is made here, not again on every worker."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "once"
    shared.mkdir(exist_ok=True)
    path, made = shared / name, shared / f"{name}.made"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            made.touch()
    return path


def reference_run(tmp_path_factory, *overrides: str, small: bool = False) -> Path:
    """`train(DIR, *overrides)` once per suite run (see `once`), keyed by its overrides: every test
    comparing with the same run reads the same directory, and none may write into it."""
    import hashlib

    key = hashlib.sha1(json.dumps([small, overrides]).encode()).hexdigest()[:16]
    return once(tmp_path_factory, f"run-{key}", lambda path: train(path, *overrides, small=small))


def train_preempted_and_resumed(run_dir: Path, step: int, *overrides: str) -> str:
    """`train(run_dir, *overrides)` sent SIGTERM (this process, as a scheduler sends it) once its metrics
    show `step`: it stops, saves and raises Preempted; then the same call again, which resumes. Returns
    what the stop said. The signal handlers are this process's again after each."""
    import threading

    from trainloop.errors import Preempted

    metrics, stop = Path(run_dir) / "metrics.jsonl", threading.Event()

    def signal_at_step():
        while not stop.is_set():
            if f'"step": {step},' in (metrics.read_text() if metrics.exists() else ""):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    watcher = threading.Thread(target=signal_at_step, daemon=True)
    watcher.start()
    try:
        with pytest.raises(Preempted, match="by SIGTERM after step") as stopped:
            train(run_dir, *overrides)
    finally:  # a preempted run ignores further signals until its process exits: this one goes on
        stop.set()
        watcher.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    train(run_dir, *overrides)
    return str(stopped.value)


def one_resumed_and_two_processes(tmp_path: Path, run: list[str], keys: tuple[str, ...]) -> list:
    """An objective's run (`run`: its overrides) on 1 process at batch 4, whose logged `keys` it returns
    (in tmp_path/one); the same stopped by SIGTERM after step 1 and resumed logs them bitwise; 2 processes
    at batch 2 log them within 1e-5 under DDP (tmp_path/ddp) and FSDP2 (tmp_path/fsdp)."""
    one = logged(train(tmp_path / "one", *run, "data.batch_size=4"), keys)
    said = train_preempted_and_resumed(tmp_path / "resumed", 1, *run, "data.batch_size=4")
    assert logged(tmp_path / "resumed", keys) == one, said  # SIGTERM, then a resume: bitwise the run not stopped
    for strategy in ("ddp", "fsdp"):
        run_dir = tmp_path / strategy
        warm(2, [*SMALL, *run, "data.batch_size=2", f"hydra.run.dir={run_dir}",
                 *(["fsdp=full_shard"] if strategy == "fsdp" else [])], cwd=tmp_path)
        assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
        assert_same_logged(logged(run_dir, keys), one, 1e-5, strategy)
    return one


# --- What a run left ------------------------------------------------------------------------------
def pairs_batch(cfg, n: int) -> dict:
    """The first `n` preference pairs of the config's data=preference rows, as the loader batches them."""
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    train_set, _ = build_datasets(cfg.data, byte_level_tokenizer(), cfg.trainer.seed)
    return {key: value[:n] for key, value in train_set.tensors.items()}


def rule_pairs(path: Path, n: int = 96) -> Path:
    """`n` preference pairs that follow one rule, written to `path`: 'Echo: TEXT' answered TEXT + '!' (chosen) or
    TEXT and one of '.?,;:' (rejected, the same length), TEXT 1 to 3 words."""
    import random

    words = "apple river stone cloud green quick seven maple lantern copper ocean violet".split()
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
        rows.append({"prompt": f"Echo: {text}\n", "chosen": text + "!", "rejected": text + rng.choice(".?,;:")})
    return write_rows(path, rows)


def with_attention_masks(batch: dict) -> dict:
    """`batch` with TRL's chosen/rejected attention masks: 1 up to each completion's last token, 0 on the padding."""
    out = dict(batch)
    for side in ("chosen", "rejected"):
        labels = batch[f"{side}_labels"]
        last = (labels != -100).long().cumsum(1).argmax(1, keepdim=True)
        out[f"{side}_attention_mask"] = (torch.arange(labels.shape[1]) <= last).long()
    return out


def touched_by_the_commit_adding(path: str) -> tuple[set[str], list[str]]:
    """(the files in trainloop/ and conf/ that the commit adding `path` touched, the lines it added and removed in
    its package's __init__.py beside it): what 'one file and one row' is read from (pytest.skip in a shallow clone)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    if git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("a shallow clone holds no history to read")
    (added,) = git("log", "--diff-filter=A", "--format=%H", "--", path).split()
    touched = {p for p in git("show", "--name-only", "--format=", added).split() if p.startswith(("trainloop/", "conf/"))}
    table = str(Path(path).parent / "__init__.py")
    row = [line[0] + line[1:].split("#")[0].strip() for line in git("show", "--format=", added, "--", table).splitlines()
           if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return touched, row


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def logged(run_dir: Path, keys: tuple[str, ...]) -> list[tuple[int, str, float]]:
    """(step, key, value) of each of `keys` on each line of metrics.jsonl that has it, in order."""
    return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in keys if key in r]


def assert_same_logged(got: list, want: list, tolerance: float, where: str = "") -> None:
    """Two runs' logged() values: the same steps and keys in the same order, each value within
    `tolerance`, relative and absolute."""
    assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in want], where
    for (step, key, x), (_, _, y) in zip(got, want):
        assert x == pytest.approx(y, rel=tolerance, abs=tolerance), (where, step, key)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def run_log(run_dir: Path) -> str:
    return (Path(run_dir) / "train.log").read_text()


def grad_norms(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r}


def sample_lines(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "samples"]


# --- Processes ------------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict:
    """The environment for a child process: offline, quiet, 1 thread per rank (2 cores here),
    and every Python process prints all its threads' stacks on SIGABRT (see `end_family`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "PYTEST_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(processes: int = 2, module: str | None = "trainloop") -> list[str]:
    """torchrun's command line for `processes` ranks of `python -m module` on this machine, on a
    free port (module None: the launcher's part, a script or `-m` to follow)."""
    return ["torchrun", "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1", "--master_port",
            str(free_port()), *(["-m", module] if module else [])]


def accelerate_launch(processes: int = 2, module: str | None = "trainloop") -> list[str]:
    """accelerate launch's command line for `processes` ranks, the same way."""
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--main_process_port",
            str(free_port()), *(["-m", module] if module else [])]


def executable(args: list[str]) -> list[str]:
    """args with 'python' as this interpreter and the launchers as this venv's."""
    if args[0] == "python":
        return [sys.executable, *args[1:]]
    if args[0] in ("torchrun", "accelerate", "deepspeed"):
        return [str(Path(sys.executable).parent / args[0]), *args[1:]]
    return list(args)


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
    args = executable(args)
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


_warm_pool = None


def warm(world_size: int, args: list[str], cwd: Path | None = None, timeout: float = 600, check: bool = True,
         env: dict | None = None, module: str = "trainloop", script: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (or `python SCRIPT ARGS`) on `world_size` ranks forked from this worker's
    warm-rank server (tests/warm_ranks.py), each with torchrun's environment on a free port (none for
    one rank: a plain `python -m`), run in `cwd`. Returns what `launch` returns: the ranks' output
    joined in rank order, the first failed rank's exit code. Past the timeout it fails with every
    rank's stacks; a rank killed by a signal fails it in one line; with check, so does any failure."""
    global _warm_pool
    from warm_ranks import WarmRanks

    if _warm_pool is None:
        _warm_pool = WarmRanks(clean_env(), Path(tempfile.gettempdir()) / f"trainloop-warm-ranks-{os.getpid()}.log")
    job = _warm_pool.run(world_size, args, Path(cwd or os.getcwd()), env or clean_env(), timeout, module,
                         str(script) if script else None, port=free_port())
    failure = job.failure(timeout)
    if failure and (check or job.timed_out or job.returncode < 0):
        pytest.fail(failure, pytrace=False)
    return subprocess.CompletedProcess(job.args, job.returncode, job.stdout, job.stderr)


def warm_runs(processes: int = 1):
    """verify_resume.main's `run`: each of its trainloop runs on `processes` warm ranks, the output in its log."""
    def run(overrides: list[str], log_file: Path) -> int:
        done = warm(processes, overrides, check=False)
        Path(log_file).write_text(done.stdout + done.stderr)
        return done.returncode
    return run


def close_warm_pool() -> list[int]:
    """End this worker's warm-rank server; the pids of its processes found alive after (then killed)."""
    global _warm_pool
    left = _warm_pool.close() if _warm_pool is not None else []
    _warm_pool = None
    return left


def start(args: list[str], output: Path) -> subprocess.Popen:
    """Started in the background, its output into a file."""
    with open(output, "w") as out:
        return subprocess.Popen(executable(args), env=clean_env(), stdout=out, stderr=subprocess.STDOUT)


# --- Processes: in the background -----------------------------------------------------------------
def finish(proc: subprocess.Popen, timeout: float) -> int | None:
    """Its exit code, or None if it ran past the timeout (then every process of it printed its
    stacks into the output); either way nothing of it is left."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_family(proc, stacks=timeout > 0)
        proc.wait()
        return None


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while f'"step": {step},' not in (metrics.read_text() if metrics.exists() else ""):
        assert proc.poll() is None, "the run ended before it was signalled"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def ranks_of(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the processes torchrun started."""
    found = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = [e for e in environ if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = int(pid)
    return found


def alive(pid: int) -> bool:
    try:  # an orphan's zombie (no init to reap it in a container) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- Data -----------------------------------------------------------------------------------------
def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversation(i: int) -> list[dict]:
    """Conversations of different lengths: some with a system message, some with two replies."""
    messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
    messages += [{"role": "user", "content": f"What is {i} plus {i}?" + " Explain." * (i % 4)},
                 {"role": "assistant", "content": f"{i} plus {i} is {2 * i}." + " Because." * (i % 5)}]
    if i % 2:
        messages += [{"role": "user", "content": "And doubled?"},
                     {"role": "assistant", "content": f"That is {4 * i}."}]
    return messages


def completions(path: Path) -> Path:
    """tests/data/preference.jsonl's prompts with their chosen completions (a sum written out), as
    prompt/completion rows: 38 to train on, 10 held out."""
    rows = [json.loads(line) for line in (DATA / "preference.jsonl").read_text().splitlines()]
    return write_rows(path, [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])


def short_texts(path: Path) -> Path:
    """400 texts of 20 to 119 characters (Python's own help topics): several documents in every block."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return write_rows(path, [{"text": topics[names[i % len(names)]][i // len(names) * 120:][:20 + i * 37 % 100]}
                             for i in range(400)])


def prepare(out: Path, *overrides: str, shard_documents: int = 10) -> dict:
    """trainloop.prepare's shards of the smoke preset's data (+ overrides) in `out`."""
    from trainloop.data.shards import prepare as write

    return write(compose_config(["+preset=smoke", *overrides]), str(out), shard_documents, progress=False)


# --- Models ---------------------------------------------------------------------------------------
def ids_tokenizer(path: Path) -> Path:
    """A byte-level tokenizer whose bos, eos (and no pad) sit where no architecture's defaults do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


def pretrained_llama(path: Path) -> Path:
    """A local model directory as a user brings one: its config and generation config keep
    Llama's defaults (bos 1, eos 2), its tokenizer says bos 256, eos 257."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(path)
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    return ids_tokenizer(path)


def adapter_tensors(final: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(final / "adapter" / "adapter_model.safetensors")


def logits_agree(final: Path, base: Path) -> tuple[str, float]:
    """final/ alone and base + final/adapter: their logits' largest difference (fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final / "adapter").eval()
    ids = torch.arange(40).unsqueeze(0) * 7 % 300
    with torch.no_grad():
        worst = (merged(input_ids=ids).logits - adapted(input_ids=ids).logits).abs().max().item()
    return type(merged).__name__, worst


def assert_samples_are_the_final_models(run_dir: Path, prompts: list[str], max_new_tokens: int) -> None:
    """Every evaluation wrote one completion per prompt; the last ones are final/'s greedy completions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines = sample_lines(run_dir)
    assert [r["step"] for r in lines] == [r["step"] for r in read_metrics(run_dir) if "eval_loss" in r]
    for line in lines:
        assert [s["prompt"] for s in line["samples"]] == prompts
        assert all(isinstance(s["text"], str) for s in line["samples"])
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    for prompt, sample in zip(prompts, lines[-1]["samples"]):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert sample["text"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), (prompt, sample)


def build_and_step(cfg):
    """The run's own builders, then one real forward, backward and optimizer step."""
    from trainloop.data.loaders import build_tokenizer
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.optim.optimizers import build_optimizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False)
    ids = torch.randint(0, len(tokenizer), (cfg.data.batch_size, cfg.data.seq_len))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind these tensors (shared ones counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# Weights after 10 Adam steps, as ||got - want|| / ||want|| per tensor: Adam divides by sqrt(v),
# so an element with a near-zero gradient turns reduction-order rounding into a visible change of
# its update (measured 5e-7 for the model, 7e-6 for the LoRA adapter, which starts from zero).
# A shard, or a replica that trained alone on half the data, is off by orders of magnitude more.
WEIGHT_TOLERANCE = 1e-4


def relative_difference(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp(min=1e-12)).item() for k in want)


def safetensors_of(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


def assert_same_weights(final: Path, reference_final: Path) -> None:
    """final/ loads with from_pretrained, holds what the reference wrote, with the same values."""
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(final).state_dict()
    want = AutoModelForCausalLM.from_pretrained(reference_final).state_dict()
    assert set(got) == set(want)
    assert set(safetensors_of(final)) == set(safetensors_of(reference_final))  # no tied alias written twice
    worst = relative_difference(got, want)
    assert worst < WEIGHT_TOLERANCE, worst


# --- Figures --------------------------------------------------------------------------------------
def panels(fig) -> dict:
    """The figure's axes by title."""
    return {ax.get_title(): ax for ax in fig.axes}


def legend_texts(fig) -> list[str]:
    return [text.get_text() for text in fig.legends[0].get_texts()]
