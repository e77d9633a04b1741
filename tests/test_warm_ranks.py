"""Warm ranks (tests/warm_ranks.py, helpers.warm) are the launched run, without the launcher's imports:
bitwise torchrun's losses and gradient norms for each layout; a hung rank fails its test with every
rank's stacks and the next job still runs; a rank killed outright fails it in one line; each job's
ranks start from torch.distributed, accelerate and Hydra as they were before any job ran; and a
closed pool leaves no process behind."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from helpers import TWO_PROCESS_RUN, clean_env, free_port, grad_norms, launch, losses, read_metrics, torchrun, warm
from warm_ranks import WarmRanks, pool_processes

LAYOUTS = {  # name: (processes, presets, overrides)
    "ddp": (2, "smoke,ddp", []),
    "fsdp": (2, "smoke,fsdp", []),
    "fsdp_tp": (2, "smoke,tp", []),
    "fsdp_tp_4": (4, "smoke,tp", ["data.batch_size=2"]),  # 2 data-parallel x 2 tensor-parallel ranks
}


def assert_warm_is_torchrun(tmp_path: Path, processes: int, presets: str, extra: list[str]) -> None:
    """10 steps under torchrun and on warm ranks: the same losses and gradient norms, bitwise."""
    args = [f"+preset=[{presets}]", *TWO_PROCESS_RUN, "data.batch_size=4", "checkpoint.save_final_model=false", *extra]
    launch([*torchrun(processes), *args, f"hydra.run.dir={tmp_path / 'torchrun'}"], cwd=tmp_path)
    warm(processes, [*args, f"hydra.run.dir={tmp_path / 'warm'}"], cwd=tmp_path)
    for run in ("torchrun", "warm"):
        assert {r["world_size"] for r in read_metrics(tmp_path / run)} == {processes}
    assert len(losses(tmp_path / "warm")) == 10
    assert losses(tmp_path / "warm") == losses(tmp_path / "torchrun")
    assert grad_norms(tmp_path / "warm") == grad_norms(tmp_path / "torchrun")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_warm_ranks_train_bitwise_what_torchrun_trains(tmp_path, layout):
    assert_warm_is_torchrun(tmp_path, *LAYOUTS[layout])


@pytest.mark.slow
def test_warm_ranks_train_bitwise_what_torchrun_trains_under_zero2(tmp_path, deepspeed_ops):
    assert_warm_is_torchrun(tmp_path, 2, "smoke,zero2", [])


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


HANG = """\
    import os, time

    def rank_waits_here():
        while True:
            time.sleep(1)

    print("rank", os.environ["RANK"], "started", flush=True)
    rank_waits_here()
"""

# what a job's ranks find when they start: nothing of an earlier job's process group, accelerate or Hydra
PROBE = """\
    import os, signal
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from hydra.core.global_hydra import GlobalHydra

    assert not dist.is_initialized()
    assert not PartialState._shared_state and not AcceleratorState._shared_state
    assert not GlobalHydra.instance().is_initialized()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    dist.init_process_group("gloo")
    total = torch.ones(1) * (int(os.environ["RANK"]) + 1)
    dist.all_reduce(total)
    assert total.item() == sum(range(1, dist.get_world_size() + 1)), total
    print("clean", os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_hung_rank_fails_with_every_ranks_stack_and_the_next_job_runs(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failed:
        warm(2, [], cwd=tmp_path, script=script(tmp_path, "hang.py", HANG), timeout=6)
    message = str(failed.value)
    assert message.startswith("warm ranks: ") and "ran past 6 s" in message.splitlines()[0], message[:500]
    for rank in (0, 1):  # each rank's own stack, printed by faulthandler on SIGABRT
        section = message.split(f"--- rank {rank} stderr")[1].split("--- rank")[0]
        assert "in rank_waits_here" in section, section
    # the same pool runs the next job: a process group, accelerate and Hydra all untouched by the last
    done = warm(2, [], cwd=tmp_path, script=script(tmp_path, "probe.py", PROBE))
    assert sorted(done.stdout.split("\n")[:2]) == ["clean 0 2 0", "clean 1 2 1"], done.stdout


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_fails_its_test_in_one_line(tmp_path):
    killed = script(tmp_path, "killed.py", """\
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # rank 0 would wait for its peer: the pool stops it
    """)
    with pytest.raises(pytest.fail.Exception) as failed:
        warm(2, [], cwd=tmp_path, script=killed, timeout=120)
    first = str(failed.value).splitlines()[0]
    assert first.startswith("warm ranks: rank 1 was killed by SIGKILL (exits by rank: [-6, -9])"), first


@pytest.mark.slow
def test_every_job_starts_clean_after_a_trainloop_run_and_a_closed_pool_leaves_no_process(tmp_path):
    """A pool of its own: a 2-process trainloop run, a probe of what the next job's ranks find, a job
    left running (with a child process of its own) when the pool closes; then no process of the
    pool is alive, counted in /proc by the variable every rank carries."""
    pool = WarmRanks(clean_env(), tmp_path / "pool.log")
    run = ["+preset=smoke", *TWO_PROCESS_RUN, "checkpoint.save_final_model=false", f"hydra.run.dir={tmp_path / 'run'}"]
    try:
        done = pool.run(2, run, tmp_path, clean_env(), timeout=300, port=free_port())
        assert done.exits == [0, 0], done.failure(300)
        assert len(losses(tmp_path / "run")) == 10
        probed = pool.run(2, [], tmp_path, clean_env(), 120, script=str(script(tmp_path, "probe.py", PROBE)),
                          port=free_port())
        assert probed.exits == [0, 0] and "clean 1 2 1" in probed.stdout, probed.failure(120)
        forked = script(tmp_path, "forks.py", """\
            import subprocess, sys, time
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print("forked", flush=True)
            time.sleep(600)
        """)
        ended = []  # what the job left running says once the pool closes under it

        def left_running():
            ended.append(pool.run(2, [], tmp_path, clean_env(), 600, script=str(forked), port=free_port()))

        job = threading.Thread(target=left_running, daemon=True)
        job.start()
        deadline = time.monotonic() + 120
        while len(pool_processes(pool.token)) < 6:  # the server, the store, 2 ranks, each with its child
            assert time.monotonic() < deadline, pool_processes(pool.token)
            time.sleep(0.1)
    finally:
        left = pool.close()
    assert left == [], f"processes of the pool alive after close: {left}"
    assert pool_processes(pool.token) == []
    job.join(timeout=60)
    assert ended and ended[0].exits == [-9, -9], ended  # the closing server killed the job's ranks

