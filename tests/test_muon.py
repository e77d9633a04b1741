"""optimizer=muon: torch.optim.Muon on the hidden layers' matrices, AdamW on the rest, built as one
optimizer from one row of trainloop/optim/optimizers.py's table. The 200-step comparison with AdamW is in
BENCHMARKS.md (too slow for the suite)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import SMALL, build_and_step, compose, storage_bytes, warm_runs
from trainloop.config.compose import ConfigError, validate
from trainloop.tools import verify_resume
from trainloop.tools.plan import plan_memory
from trainloop.tools.shape import model_shape


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(arch):
    cfg = compose(*SMALL, "optimizer=muon", f"model.arch={arch}")
    model, optimizer = build_and_step(cfg)
    muon, adamw = optimizer.parts
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    names = {id(p): name for name, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}

    layers = "model.layers." if arch == "llama" else "transformer.h."
    assert in_muon == {n for n, p in model.named_parameters() if n.startswith(layers) and p.dim() == 2}
    assert in_adamw == set(names.values()) - in_muon
    embeddings = {n for n in in_adamw if "embed" in n or n.endswith(("wte.weight", "wpe.weight"))}
    assert embeddings and any(p.dim() == 1 for n, p in model.named_parameters() if n in in_adamw)
    # the wrapper's groups and state are the parts' own: what the scheduler and checkpoints see
    assert optimizer.param_groups == muon.param_groups + adamw.param_groups
    assert muon.state is adamw.state is optimizer.state
    assert all(len(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_planned_state_bytes_are_the_live_ones(arch):
    """Muon's momentum for the matrices, AdamW's two moments and step for embeddings, norms, biases."""
    cfg = compose(*SMALL, "optimizer=muon", f"model.arch={arch}")
    planned = plan_memory(cfg, model_shape(cfg), world_size=1, device="cpu").get("optimizer states")
    _, optimizer = build_and_step(cfg)
    assert planned == storage_bytes(v for state in optimizer.state.values() for v in state.values())
    adamw_only = compose(*SMALL, "optimizer=adamw", f"model.arch={arch}")
    assert planned < plan_memory(adamw_only, model_shape(adamw_only), world_size=1, device="cpu").get("optimizer states")


@pytest.mark.slow
def test_muon_trains_and_resumes_bitwise(tmp_path, capsys, child_env):  # noqa: F811
    code = verify_resume.main(["--steps", "6", "--rtol", "0", "--dir", str(tmp_path), "+preset=smoke",
                               "optimizer=muon", "trainer.eval_batches=2"], run=warm_runs())
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("bitwise identical") == 2, out
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_is_refused_naming_the_keys(stage):
    with pytest.raises(ConfigError, match=rf"optimizer=muon cannot run under deepspeed.*{stage}") as refused:
        validate(compose("optimizer=muon", f"deepspeed=zero{stage}"))
    assert "use optimizer=adamw, or deepspeed=none" in str(refused.value)
