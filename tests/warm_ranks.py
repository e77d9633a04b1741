"""Warm ranks: multi-process runs as jobs on ranks that have already imported the libraries.

A process that imports torch, transformers, accelerate, datasets and DeepSpeed pays about 6.5 s
here before its first step; a 2-process torchrun launch pays it three times (the launcher and each
rank), and the suite's equivalence runs are mostly that. So each pytest worker starts one server
(`python tests/warm_ranks.py`) that imports them once and then, for each job, forks its ranks:
fresh processes, with the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, as torchrun sets them), that run `python -m trainloop ARGS` (or
another module, or a script) from their first line, exit with its code and leave their output in
files. A fork is a new process, so whatever a job does to torch.distributed, accelerate's
singletons, Hydra or the signal handlers ends with it: the server itself never computes, never
starts a thread and never joins a process group, and so forks clean every time (accelerate's
`debug_launcher` forks after the imports the same way; DeepSpeed's reused pool of live ranks had to
learn to guard their teardown, which forking per job does not need).

What a fork shares with its server and a launched rank would not: the imported modules and
Python's string-hash seed (so a set's order agrees across ranks here where it may differ under
torchrun). The launchers themselves, signals, exit codes and the install keep real subprocesses
(tests/test_launch.py, test_distributed.py, ...); tests/test_warm_ranks.py shows warm ranks equal
to torchrun bitwise.

The protocol is one JSON line each way on two pipes: a job {world_size, module | script, args,
cwd, env, out, port} is answered {pids} once its ranks (and, for several, the store they meet at,
held outside them as torchrun's agent holds it) are forked and {exits} once all have
ended. When one rank fails, the others get FAILED_GRACE_S to end by themselves (a rank refusing a
config, the others soon see their peer gone), then SIGABRT (each prints its stacks) and SIGKILL.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FAILED_GRACE_S = 10.0  # after a rank failed, the others' time to end by themselves
STACKS_S = 3.0  # after SIGABRT, each rank's time to print its stacks
START_S = 300.0  # the server's imports (about 10 s idle; far more on a loaded 2-core host)
POOL_VAR = "TRAINLOOP_WARM_POOL"  # the pool's token, in the environment of its server, its ranks and their children

PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "torch.distributed.pipelining",
           "numpy", "datasets", "transformers", "accelerate", "hydra", "omegaconf", "peft", "safetensors.torch",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.mixtral.modeling_mixtral", "deepspeed", "trainloop.config.compose", "trainloop.lifetime", "trainloop.run")


# --- The server (`python tests/warm_ranks.py REQUESTS_FD REPLIES_FD`) -------------------------------
def serve(requests: int, replies: int) -> None:
    """Import the libraries, then run jobs until the requests pipe closes (the pytest worker is gone).
    A forked rank leaves this function only by raising SystemExit (or an uncaught error), so it ends
    as `python -m trainloop` ends: exit handlers, non-daemon threads, flushed streams."""
    import importlib

    # as a fresh `python` starts: an ignored signal is inherited through exec, and a pytest worker whose
    # in-process run was preempted ignores SIGTERM for the rest of its life (trainloop.preemption)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, threading.enumerate()  # fork only a single-threaded process
    reader = os.fdopen(requests, "r")
    reply(replies, ready=os.getpid())
    for line in reader:
        job = json.loads(line)
        store = fork_store(job, reader, replies) if job["world_size"] > 1 else None
        pids = [fork_rank(job, rank, reader, replies) for rank in range(job["world_size"])]
        reply(replies, pids=pids)
        exits, first = wait_for(pids, requests)
        if store is not None:  # the launcher's store ends after its ranks, as torchrun's agent does
            stop([store], signal.SIGKILL)
            try:
                os.waitpid(store, 0)
            except ChildProcessError:  # already reaped by wait_for
                pass
        reply(replies, exits=exits, first=first)


def reply(fd: int, **message) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def forked(job: dict, name: str, requests, replies: int) -> int:
    """0 in the child: its own session (as torchrun starts each rank), its output in files NAME.out
    and NAME.err of the job's folder; the child's pid in the server."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    requests.close()
    os.close(replies)
    out = Path(job["out"])
    for fd, path in ((0, os.devnull), (1, out / f"{name}.out"), (2, out / f"{name}.err")):
        opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    return 0


def fork_store(job: dict, requests, replies: int) -> int:
    """The rendezvous store on the job's port, in a process of its own, as torchrun's agent holds it
    (TORCHELASTIC_USE_AGENT_STORE): every rank is its client, so no rank's exit takes the store from
    a peer still tearing its process group down. Killed once every rank has ended."""
    pid = forked(job, "store", requests, replies)
    if pid:
        return pid
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", job["port"], job["world_size"], is_master=True,
                         timeout=timedelta(seconds=900), wait_for_workers=False)
        while store is not None:  # held until killed
            time.sleep(3600)
    finally:
        os._exit(1)


def fork_rank(job: dict, rank: int, requests, replies: int) -> int:
    pid = forked(job, f"rank{rank}", requests, replies)
    if pid:
        return pid
    os.chdir(job["cwd"])
    token = os.environ[POOL_VAR]
    os.environ.clear()
    os.environ.update(job["env"], **{POOL_VAR: token})
    if job["world_size"] > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["world_size"]),
                          LOCAL_WORLD_SIZE=str(job["world_size"]), GROUP_RANK="0", ROLE_RANK=str(rank),
                          ROLE_WORLD_SIZE=str(job["world_size"]), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(job["port"]), TORCHELASTIC_USE_AGENT_STORE="True")
    import numpy  # a new process draws numpy's global state from the OS (Python's random reseeds at fork itself)

    numpy.random.seed()
    import runpy

    if job["module"]:  # python -m MODULE ARGS: the working directory first on the path
        sys.argv = [job["module"], *job["args"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
    else:  # python SCRIPT ARGS: the script's folder first on the path
        sys.argv = [job["script"], *job["args"]]
        sys.path[0] = str(Path(job["script"]).resolve().parent)
        runpy.run_path(job["script"], run_name="__main__")
    raise SystemExit(0)


def wait_for(pids: list[int], requests: int) -> tuple[list[int], int | None]:
    """Each rank's exit (its code, or minus the signal that ended it) and the rank that failed first
    (None if none did). After the first failure the others get FAILED_GRACE_S to end, then SIGABRT
    (their stacks), then SIGKILL. The pytest worker gone (the requests pipe at EOF): all killed at once."""
    exits: dict[int, int] = {}
    first, escalation, due = None, [], 0.0
    while len(exits) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            exits[pid] = os.waitstatus_to_exitcode(status)
            if exits[pid] != 0 and first is None:
                first, due = pids.index(pid), time.monotonic() + FAILED_GRACE_S
                escalation = [signal.SIGABRT, signal.SIGKILL]
            continue
        alive = [p for p in pids if p not in exits]
        if select.select([requests], [], [], 0.02)[0] and not os.read(requests, 1):
            stop(alive, signal.SIGKILL)
            escalation = []
        elif escalation and time.monotonic() >= due:
            stop(alive, escalation.pop(0))
            due = time.monotonic() + STACKS_S
    return [exits[p] for p in pids], first


def stop(pids: list[int], sig: int) -> None:
    """`sig` to each rank's process group (the rank and what it started: DataLoader workers, a pool)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# --- The client (in the pytest worker) ----------------------------------------------------------
@dataclass
class Job:
    args: list[str]
    exits: list[int]
    first: int | None  # the rank that failed first
    outputs: list[tuple[str, str]]  # each rank's (stdout, stderr)
    timed_out: bool

    @property
    def returncode(self) -> int:
        """0, or the exit of the rank that failed first (minus its signal)."""
        return 0 if self.first is None else self.exits[self.first]

    @property
    def stdout(self) -> str:
        return "".join(out for out, _ in self.outputs)

    @property
    def stderr(self) -> str:
        return "".join(err for _, err in self.outputs)

    def failure(self, timeout: float) -> str | None:
        """What went wrong, in its first line, then every rank's output; None if every rank exited 0."""
        if self.timed_out:
            first = f"warm ranks: {' '.join(self.args)} ran past {timeout:.0f} s; every rank's stacks follow"
        elif self.first is None:
            return None
        elif self.returncode < 0:
            first = (f"warm ranks: rank {self.first} was killed by {signal.Signals(-self.returncode).name} "
                     f"(exits by rank: {self.exits}): {' '.join(self.args)}")
        else:
            first = f"warm ranks: rank {self.first} exited {self.returncode} (exits by rank: {self.exits}): {' '.join(self.args)}"

        tails = [f"--- rank {rank} stdout\n{out[-3000:]}\n--- rank {rank} stderr\n{err[-8000:]}"
                 for rank, (out, err) in enumerate(self.outputs)]
        return "\n".join([first, *tails])


class WarmRanks:
    """One server per pytest worker, started at its first job and ended by close() (or by the
    worker's exit, which closes the requests pipe)."""

    def __init__(self, env: dict[str, str], log: Path):
        import uuid

        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.env, self.log = {**env, POOL_VAR: self.token}, log
        self.server: subprocess.Popen | None = None
        self.lock = threading.Lock()  # one job at a time: a test's own threads queue here
        self.buffer = b""

    def start(self) -> None:
        requests_r, self.requests = os.pipe()
        self.replies, replies_w = os.pipe()
        with open(self.log, "ab") as log:
            self.server = subprocess.Popen([sys.executable, __file__, str(requests_r), str(replies_w)],
                                           pass_fds=(requests_r, replies_w), env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        os.close(requests_r)
        os.close(replies_w)
        ready = self.read(START_S)
        if ready is None or "ready" not in ready:
            self.close()
            raise RuntimeError(f"the warm-rank server did not start; its log:\n{self.log.read_text()[-6000:]}")

    def read(self, timeout: float) -> dict | None:
        """The next reply, or None at the deadline or if the server is gone."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, world_size: int, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
            module: str | None = "trainloop", script: str | None = None, port: int = 0) -> Job:
        with self.lock:
            if self.server is None or self.server.poll() is not None:
                self.start()
            server = self.server
            out = Path(tempfile.mkdtemp(prefix="warm-job-"))
            job = dict(world_size=world_size, module=None if script else module, script=script, args=list(args),
                       cwd=str(cwd), env=env, out=str(out), port=port)
            os.write(self.requests, (json.dumps(job) + "\n").encode())
            forked = self.read(60)
            if forked is None:
                raise RuntimeError(f"the warm-rank server forked no ranks; its log:\n{self.log.read_text()[-6000:]}")
            ended = self.read(timeout)
            if ended is None and server.poll() is not None:
                raise RuntimeError(f"the warm-rank server ended during the job (exit {server.returncode})")
            timed_out = ended is None
            if timed_out:  # every rank prints its stacks (faulthandler, PYTHONFAULTHANDLER), then ends
                stop(forked["pids"], signal.SIGABRT)
                time.sleep(STACKS_S)
                stop(forked["pids"], signal.SIGKILL)
                ended = self.read(60)
                if ended is None:
                    raise RuntimeError("the warm-rank server did not reap the ranks it was told to kill")
            # as written: read_text would turn a progress bar's carriage returns into newlines
            outputs = [tuple((out / f"rank{rank}.{kind}").read_bytes().decode(errors="replace") for kind in ("out", "err"))
                       for rank in range(world_size)]
            for path in out.iterdir():  # the ranks' files and the store's
                path.unlink()
            out.rmdir()
            return Job(list(args), ended["exits"], ended["first"], outputs, timed_out)

    def close(self) -> list[int]:
        """End the server (its ranks with it); returns the pids of any process of this pool still
        alive afterwards, which it then kills: there should be none. A job still running fails."""
        if self.server is None:
            return []
        os.close(self.requests)
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        if self.lock.acquire(blocking=False):  # no job is reading the replies: close them too
            os.close(self.replies)
            self.lock.release()
        left = pool_processes(self.token)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.server = None
        return left


def pool_processes(token: str) -> list[int]:
    """Live processes that carry the pool's token: its server, its ranks and what they started (a
    forked rank's /proc environ is the server's; what a rank executes inherits the variable)."""
    marker = f"{POOL_VAR}={token}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0") and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
