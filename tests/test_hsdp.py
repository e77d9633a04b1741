"""Hybrid sharding (parallel.dp_replicate, issue 59's proof that a strategy is one file and one row): 4
processes as 2 replicas x 2 shards train as one process does within 1e-5 (every logged loss, gradient norm
and the evaluation), the model really sharded over a 2-D mesh; what it cannot run is refused naming the key;
and the commit that added it touched, in trainloop/ and conf/, its file, its row and its YAML alone.

Real parts only: the composed config, FSDP2 (fully_shard over a 2-D DeviceMesh), 4 warm ranks over gloo."""

from __future__ import annotations

import pytest

from helpers import (
    TWO_PROCESS_RUN, compose, logged, read_metrics, reference_run, run_log, touched_by_the_commit_adding, warm,
)
from trainloop.config.compose import ConfigError, validate

KEYS = ("loss", "grad_norm", "eval_loss")
TOLERANCE = 1e-5


@pytest.mark.slow
def test_two_replicas_of_two_shards_train_as_one_process_does(tmp_path_factory, tmp_path):
    reference = reference_run(tmp_path_factory, "+preset=smoke", *TWO_PROCESS_RUN, "data.batch_size=8")
    run_dir = tmp_path / "run"
    warm(4, ["+preset=[smoke,hsdp]", *TWO_PROCESS_RUN, "data.batch_size=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert {r["world_size"] for r in read_metrics(run_dir) if "world_size" in r} == {4}
    log = run_log(run_dir)
    # sharded over a (dp_replicate, dp_shard) mesh: each parameter replicated over the first, split over the second
    assert "mesh cpu (2, 2)" in log and "Replicate(), Shard(dim=0)" in log, log[-3000:]
    got, want = logged(run_dir, KEYS), logged(reference, KEYS)
    assert [x[:2] for x in got] == [x[:2] for x in want] and got
    for (step, key, x), (_, _, y) in zip(got, want):
        assert x == pytest.approx(y, rel=TOLERANCE, abs=TOLERANCE), (step, key, x, y)
    assert len({x for _, key, x in want if key == "loss"}) > 1  # the model moved


@pytest.mark.parametrize("overrides, says", [
    (["+preset=smoke", "parallel.dp_replicate=2"], "parallel.dp_replicate=2 replicates FSDP2's shards, and fsdp=none shards nothing"),
    (["+preset=[smoke,hsdp]", "parallel.tp_size=2"], "parallel.dp_replicate=2 with parallel.tp_size=2: hybrid sharding runs"),
    (["+preset=[smoke,hsdp]", "parallel.cp_size=2"], "parallel.dp_replicate=2 with parallel.cp_size=2"),
    (["+preset=[smoke,hsdp]", "parallel.dp_replicate=0"], "parallel.dp_replicate=0 must be 1 or more"),
])
def test_what_it_cannot_run_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        validate(compose(*overrides))


def test_the_preset_chooses_it_and_the_planner_holds_a_shard_group_s_share(capsys):
    """8 processes as 2 replicas: each holds what FSDP2 over 4 holds, and the replicas all-reduce 1/4 of the
    gradients beside FSDP2's gathers and reduce-scatters within a group."""
    import json

    from trainloop.parallel import chosen
    from trainloop.tools.plan import main as plan_main

    assert chosen(compose("+preset=[smoke,hsdp]")) == "hsdp"
    assert chosen(compose("+preset=[smoke,fsdp]")) == "fsdp2"
    plans = []
    for overrides in (["+preset=[smoke,hsdp]", "--world-size", "8"], ["+preset=[smoke,fsdp]", "--world-size", "4"]):
        plan_main([*overrides, "--json", "--no-presets"])
        plans.append(json.loads(capsys.readouterr().out)["config"]["plan"])
    hybrid, fsdp = plans
    assert [(x["what"], x["bytes"]) for x in hybrid["lines"]] == [(x["what"], x["bytes"]) for x in fsdp["lines"]]
    assert hybrid["traffic"][:2] == fsdp["traffic"][:2]
    (extra,) = hybrid["traffic"][2:]
    assert extra["what"] == "gradient shard all-reduce over the replicas" and extra["bytes"] == fsdp["num_params"]


def test_the_commit_that_added_it_touched_only_its_file_its_row_and_its_yaml():
    touched, row = touched_by_the_commit_adding("trainloop/parallel/hsdp.py")
    assert touched == {"trainloop/parallel/hsdp.py", "trainloop/parallel/__init__.py", "conf/preset/hsdp.yaml"}
    assert row == ["+from trainloop.parallel.hsdp import HybridShard", '+"hsdp": HybridShard,']


def test_the_planner_weighs_its_preset_beside_a_one_process_config(capsys):
    """`python -m trainloop.plan` plans every preset at the config's world size, one process here, which hybrid
    sharding cannot launch on: its lines are one process's shards, with no replica to all-reduce with."""
    import json

    from trainloop.tools.plan import main as plan_main

    plan_main(["+preset=smoke", "--json"])
    hybrid = json.loads(capsys.readouterr().out)["presets"]["hsdp"]["plan"]
    assert hybrid["world_size"] == 1 and hybrid["lines"]
    assert not any("replicas" in t["what"] for t in hybrid["traffic"])
