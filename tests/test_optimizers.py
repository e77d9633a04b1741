"""The optimizer table (trainloop/optim/optimizers.py) is the one place an optimizer is described: the
YAML options, validate(), the config reference and the planner all follow it. Nothing here
names an optimizer: each test walks conf/optimizer/ and the table."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import REPO, compose
from trainloop.config.compose import CONFIG_DIR, ConfigError, validate
from trainloop.optim.optimizers import OPTIMIZERS, build_optimizer, planned_state_bytes
from trainloop.tools.plan import main as plan_main
from trainloop.tools.shape import model_shape

OPTIONS = sorted(p.stem for p in (CONFIG_DIR / "optimizer").glob("*.yaml"))


def test_the_options_the_table_and_the_reference_agree():
    assert OPTIONS and set(OPTIONS) == set(OPTIMIZERS)
    reference = (REPO / "docs" / "config-reference.md").read_text()
    rows = [line for line in reference.splitlines() if line.startswith("| `") and "state B/param" not in line]
    for name, spec in OPTIMIZERS.items():
        row = next((r for r in rows if r.startswith(f"| `{name}` | ") and r.count("|") == 9), None)
        assert row is not None, f"docs/config-reference.md has no table row for {name}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3:] == [{True: "yes", False: "no"}[v]
                             for v in (spec.cpu_offload, spec.zero, spec.zero3, spec.fsdp2, spec.cuda_only)]


@pytest.mark.parametrize("name", OPTIONS)
def test_validate_accepts_an_optimizer_where_the_table_says_it_works(name):
    spec = OPTIMIZERS[name]
    for extra, works in (([], True), (["deepspeed=zero2"], spec.zero), (["deepspeed=zero3"], spec.zero3),
                         (["deepspeed=zero2", "deepspeed.offload_optimizer=cpu"], spec.cpu_offload),
                         (["+preset=fsdp"], spec.fsdp2)):
        cfg = compose(f"optimizer={name}", *extra)
        if works:
            validate(cfg)
        else:
            with pytest.raises(ConfigError, match=f"optimizer={name}"):
                validate(cfg)


@pytest.mark.parametrize("name", OPTIONS)
def test_an_optimizer_builds_on_cpu_unless_the_table_says_cuda_only(name):
    import torch

    cfg = compose(f"optimizer={name}")
    model = torch.nn.Linear(8, 8)
    if OPTIMIZERS[name].cuda_only:
        with pytest.raises(ConfigError, match=f"optimizer={name}"):
            build_optimizer(cfg.optimizer, model, on_cuda=False)
    else:
        assert build_optimizer(cfg.optimizer, model, on_cuda=False).param_groups


@pytest.mark.parametrize("name", OPTIONS)
def test_the_planner_prints_the_state_bytes_of_every_optimizer(name, capsys):
    overrides = ["+preset=smoke", f"optimizer={name}"]
    assert plan_main(["--no-presets", "--json", *overrides]) == 0
    report = json.loads(capsys.readouterr().out)
    lines = {line["what"]: line for line in report["config"]["plan"]["lines"]}
    cfg = compose(*overrides)
    shape = model_shape(cfg)
    expected = planned_state_bytes(cfg.optimizer, shape.shapes, shape.hidden_matrix)
    assert lines["optimizer states"]["bytes"] == expected > 0
    assert name in lines["optimizer states"]["note"]


@pytest.mark.parametrize("name,theirs", [("cosine", "cosine"), ("linear", "linear"), ("constant", "constant_with_warmup")])
def test_the_schedules_are_transformers_own(name, theirs):
    """trainloop writes the three schedules itself (importing transformers.optimization costs every
    run ~2 s of peft and bitsandbytes imports); they are get_scheduler's, value for value."""
    from transformers import get_scheduler

    from trainloop.config.sections import SchedulerConfig
    from trainloop.optim.optimizers import build_scheduler

    for warmup, total in ((0, 1), (0, 50), (7, 50), (10, 500)):
        ours = build_scheduler(SchedulerConfig(name=name, warmup_steps=warmup), torch.optim.SGD([torch.zeros(1)], lr=1), total)
        hf = get_scheduler(theirs, torch.optim.SGD([torch.zeros(1)], lr=1), num_warmup_steps=warmup,
                           num_training_steps=total)
        assert [ours.lr_lambdas[0](s) for s in range(total + 2)] == [hf.lr_lambdas[0](s) for s in range(total + 2)]
