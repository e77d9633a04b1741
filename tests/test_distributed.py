"""Scale-out for real: 2 CPU processes over gloo under torchrun, accelerate launch and the
deepspeed launcher; DDP and DeepSpeed ZeRO-2/ZeRO-3 with CPU and NVMe offload; DDP on two "nodes"
over loopback (torchrun through scripts/launch_multinode.sh, and accelerate launch).

Every run trains the smoke model for 10 steps at per-process batch 4 and is compared step by
step with one process at batch 8 (same seed, same data: accelerate gives rank 0 the first 4
samples of the global batch and rank 1 the next 4). fp32 DDP must agree to 1e-5 relative,
ZeRO-2/3 to 1e-3 (DeepSpeed's flattened reductions round differently: about 7e-5 measured).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    DDP_TOLERANCE, REPO, TWO_PROCESS_RUN, TWO_PROCESS_STEPS, ZERO_TOLERANCE, accelerate_launch, clean_env,
    free_port, launch, losses, read_metrics, reference_run, run_log, warm,
)



def overrides(preset: str, *extra: str) -> list[str]:
    return [f"+preset=[smoke,{preset}]", *TWO_PROCESS_RUN, *extra]


def assert_matches(run_dir: Path, reference: dict[int, float], tolerance: float) -> None:
    got = losses(run_dir)
    assert sorted(got) == list(range(1, TWO_PROCESS_STEPS + 1))
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    assert worst < tolerance, f"largest relative difference {worst:.2e} (tolerance {tolerance:.0e}): {got} vs {reference}"


def assert_two_ranks_wrote_one_run(root: Path, run_dir: Path) -> None:
    """Only the main process writes metrics, in the one run dir, and says world_size 2."""
    assert [p.parent for p in root.rglob("metrics.jsonl")] == [run_dir]
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}


def assert_loadable(run_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of one process at batch 8: what 2 processes at batch 4 must reproduce (the run
    tests/test_fsdp.py compares with too, made once)."""
    return losses(reference_run(tmp_path_factory, "+preset=smoke", *TWO_PROCESS_RUN, "data.batch_size=8"))


@pytest.mark.slow
def test_accelerate_launch_zero3_offload_exports_what_deepspeed_consolidates(tmp_path, reference, deepspeed_ops):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    launch([*accelerate_launch(2), *overrides("zero3_offload", *HARNESS), f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert ("DeepSpeed ZeRO-3 engaged with optimizer offload to cpu and parameter offload to cpu "
            "(DistributedType.DEEPSPEED, 2 process(es)") in run_log(run_dir)
    assert_two_ranks_wrote_one_run(tmp_path, run_dir)
    assert_matches(run_dir, reference, ZERO_TOLERANCE)

    # acceptance 4: the exported weights are DeepSpeed's own consolidation of the last checkpoint
    checkpoint = run_dir / "checkpoints" / f"step_{TWO_PROCESS_STEPS:07d}"
    assert len(list(checkpoint.rglob("zero_pp_rank_*_optim_states.pt"))) == 2
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    assert set(consolidated) <= set(exported)
    different = [k for k in consolidated if not torch.equal(consolidated[k], exported[k])]
    assert not different, f"{len(different)} tensors differ from zero_to_fp32, e.g. {different[:3]}"
    assert_harness_scored_final(run_dir, tmp_path)


# lm-evaluation-harness at the end (eval.harness): under ZeRO-3 every rank takes part in each forward
HARNESS = ("eval.harness.tasks=[pydoc_order,pydoc_words]", "eval.harness.limit=20")


def assert_harness_scored_final(run_dir: Path, tmp_path: Path) -> None:
    """The scores logged at the end are final/'s, as `python -m trainloop.evaluate` scores it."""
    import json

    from trainloop.tools.evaluate import main

    (logged,) = [r for r in read_metrics(run_dir) if r.get("event") == "harness"]
    main([str(run_dir), "--tasks", "pydoc_order,pydoc_words", "--limit", "20", "--output", str(tmp_path / "h.json")])
    final = json.loads((tmp_path / "h.json").read_text())["results"]
    keys = [k for k in logged if "/" in k and not k.endswith("_stderr")]
    assert keys and all(abs(final[k.split("/")[0]][k.split("/")[1] + ",none"] - logged[k]) <= 1e-6 for k in keys), \
        (logged, final)


@pytest.mark.slow
def test_deepspeed_launcher_zero2_matches_one_process(tmp_path, reference, deepspeed_ops):
    run_dir = tmp_path / "run"
    launch(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "trainloop",
            *overrides("zero2"), f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert "DeepSpeed ZeRO-2 engaged (DistributedType.DEEPSPEED, 2 process(es)" in run_log(run_dir)
    assert_two_ranks_wrote_one_run(tmp_path, run_dir)
    assert_matches(run_dir, reference, ZERO_TOLERANCE)
    assert_loadable(run_dir)


def node_command(launcher: str, node_rank: int, port: int) -> tuple[list[str], dict]:
    """One node's command: scripts/launch_multinode.sh (torchrun), or accelerate launch with the
    example config file, each told it is node `node_rank` of 2 with 1 process."""
    if launcher == "launch_multinode.sh":
        env = clean_env(NNODES="2", NODE_RANK=str(node_rank), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), PYTHON=sys.executable)
        return ["bash", str(REPO / "scripts" / "launch_multinode.sh")], env
    accelerate = str(Path(sys.executable).parent / "accelerate")
    return [accelerate, "launch", "--config_file", str(REPO / "scripts" / "accelerate_config.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(node_rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "-m", "trainloop"], clean_env()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch_multinode.sh", "accelerate"])
def test_two_nodes_over_loopback(tmp_path, reference, launcher):
    """Two "nodes" on this machine, 1 process each, meeting at a rendezvous on 127.0.0.1: torchrun (the
    script runs torch.distributed.run) or accelerate launch. Each rank names a different run dir: rank
    0's must be taken by both, rank 1's removed."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        command, env = node_command(launcher, rank, port)
        nodes.append(subprocess.Popen([*command, *overrides("ddp"), "hydra.run.dir=runs/rank${oc.env:RANK}"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    run_dir = tmp_path / "runs" / "rank0"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["rank0"], outputs[1][-2000:]
    assert "DistributedType.MULTI_CPU (2 process(es)" in run_log(run_dir)
    assert "backend gloo" in run_log(run_dir)
    assert_two_ranks_wrote_one_run(tmp_path, run_dir)
    assert_matches(run_dir, reference, DDP_TOLERANCE)
    assert_loadable(run_dir)


@pytest.mark.slow
def test_zero3_nvme_offload_swaps_to_the_given_folder(tmp_path, deepspeed_ops):
    """The set-up for models too big for memory: built partitioned (zero3_init), swapped to disk."""
    run_dir, swap = tmp_path / "run", tmp_path / "swap"
    warm(2, ["+preset=[smoke,zero3_nvme]", f"deepspeed.nvme_path={swap}", "deepspeed.zero3_init=true",
             *TWO_PROCESS_RUN[1:], "trainer.max_steps=3", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert ("DeepSpeed ZeRO-3 engaged with optimizer offload to nvme and parameter offload to nvme"
            in run_log(run_dir))
    assert len(losses(run_dir)) == 3
    # DeepSpeed swapped each rank's parameters and optimizer state through files under nvme_path
    swapped = {p.relative_to(swap).parts[1:] for p in swap.glob("zero_stage_3/*/rank*")}
    assert {("optimizer", "rank0"), ("optimizer", "rank1")} <= swapped, sorted(swap.rglob("*"))
    assert any(kind.endswith("params") for kind, _ in swapped), swapped
    assert_loadable(run_dir)
