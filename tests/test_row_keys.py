"""Each objective, data format and strategy declares its keys beside its code (issue 34, item 4):
trainloop/config/schema.py composes them, an objective's option takes its defaults from its row, and
a key added to one row's dataclass reaches the config, the refusals, the checkpoint's fingerprint
and the generated reference with no other file touched."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, compose
from trainloop.config import schema, sections
from trainloop.data.formats import FORMATS
from trainloop.objectives import OBJECTIVES


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_each_row_declares_its_keys_in_its_own_module():
    for table, rows, package in (("objective", OBJECTIVES, "objectives"), ("data", FORMATS, "data/formats")):
        for name, row in rows.items():
            if row.keys is None:
                continue
            assert Path(inspect.getsourcefile(row.keys)).is_relative_to(REPO / "trainloop" / package), (table, name)
    from trainloop.parallel import STRATEGIES

    for section, module in ((schema.DeepSpeedConfig, "parallel/deepspeed_config.py"),
                            (schema.FsdpConfig, "parallel/fsdp2.py"), (STRATEGIES["fsdp2_tp"].keys, "parallel/tp.py"),
                            (STRATEGIES["pipeline"].keys, "parallel/pipeline.py"), (schema.ParallelKeys, "parallel/base.py")):
        assert Path(inspect.getsourcefile(section)) == REPO / "trainloop" / module
    # the parallel section is the strategy rows' keys (their `keys`), each declared beside its row, and the one
    # every strategy reads (parallel.cp_size) beside the base strategy
    rows_keys = {key for row in STRATEGIES.values() if row.keys for key in names(row.keys)}
    assert {"tp_size", "sequence_parallel", "pp_size", "pp_schedule", "pp_stages_per_rank"} <= rows_keys
    assert set(names(schema.ParallelConfig)) == rows_keys | {"cp_size"} == rows_keys | set(names(schema.ParallelKeys))


def test_a_tables_section_holds_its_shared_keys_and_every_rows_once():
    objective_keys = {key for row in OBJECTIVES.values() if row.keys for key in names(row.keys)}
    assert set(names(schema.ObjectiveConfig)) == {"name"} | objective_keys
    format_keys = {key for row in FORMATS.values() if row.keys for key in names(row.keys)}
    assert names(schema.DataConfig) == names(sections.DataConfig) + [k for k in names(schema.DataConfig)
                                                                     if k in format_keys]
    assert set(names(schema.DataConfig)) == set(names(sections.DataConfig)) | format_keys
    # a key two rows declare is one key, said for each row that reads it
    assert [row for row, _ in schema.ObjectiveConfig.declared_by["beta"]] == ["dpo", "simpo", "grpo", "kto", "distill", "orpo"]
    assert [row for row, _ in schema.DataConfig.declared_by["prompt_field"]] == ["prompt_completion", "preference",
                                                                                 "unpaired", "prompts"]


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_an_objective_option_has_its_rows_defaults(objective):
    """conf/objective/NAME.yaml extends the row's schema: beta is 0.1 under dpo, 2.0 under simpo, 0.0 under grpo."""
    row = OBJECTIVES[objective]
    overrides = {"dpo": ["data=preference", "data.path=p.jsonl"], "simpo": ["data=preference", "data.path=p.jsonl"],
                 "grpo": ["data=prompts", "data.path=p.jsonl", "objective.rewards=[m:f]"]}.get(objective, [])
    cfg = compose(f"objective={objective}", *overrides)
    assert cfg.objective.name == objective
    for key in dataclasses.fields(row.keys) if row.keys else ():
        expected = key.default_factory() if key.default_factory is not dataclasses.MISSING else key.default
        if key.name != "rewards":
            assert cfg.objective[key.name] == expected, key.name
    if objective == "simpo":
        assert (cfg.objective.beta, cfg.objective.gamma) == (2.0, 1.0)
    if objective == "grpo":
        assert (cfg.objective.beta, cfg.objective.loss_type) == (0.0, "dapo")


ADDED_KEY = '''
from dataclasses import dataclass

from trainloop.objectives.dpo import DPOConfig


@dataclass
class DPOWithMargin(DPOConfig):
    margin: float = 0.25  # a probe key: the reward margin a pair must clear
'''

PROBE = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from added import DPOWithMargin
from trainloop.objectives.dpo import DPO
DPO.keys = DPOWithMargin  # the one change: a field in the row's dataclass

from trainloop.config.compose import ConfigError, check_command_line, compose_config
from trainloop.objectives import keys_read
from trainloop.tools.reference import render

pairs = ["data=preference", "data.path=p.jsonl"]
out = {}
dpo = ["objective=dpo", *pairs, "objective.margin=0.5"]
cfg = compose_config(dpo)
check_command_line(cfg, dpo)
out["value"], out["fingerprint"] = cfg.objective.margin, list(keys_read(cfg))
out["default"] = compose_config(["objective=dpo", *pairs]).objective.margin
simpo = ["objective=simpo", *pairs, "objective.margin=0.5"]
try:
    check_command_line(compose_config(simpo), simpo)
except ConfigError as err:
    out["refused"] = str(err)
out["reference"] = [line for line in render().splitlines() if "objective.margin" in line]
print(json.dumps(out))
'''


def test_a_key_added_to_one_objective_reaches_config_refusals_fingerprint_and_reference(tmp_path):
    (tmp_path / "added.py").write_text(ADDED_KEY)
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["value"], out["default"]) == (0.5, 0.25)
    assert "objective.margin" in out["fingerprint"]
    assert "objective.margin=0.5 has no effect unless objective=dpo" in out["refused"]
    table_row = [line for line in out["reference"] if line.startswith("| `objective.margin`")]
    assert table_row == ["| `objective.margin` | float | `0.25` |  | objective=dpo: a probe key: the reward margin a "
                         "pair must clear |"]
    assert any("`objective.margin=0.25`" in line for line in out["reference"])  # dpo's option row
