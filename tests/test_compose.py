"""compose_config composes each set of group choices once and applies the other overrides to a copy with Hydra's
own function: what it returns, and what it refuses, is what one whole Hydra compose returns and refuses."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from helpers import NEEDS
from trainloop.config.compose import COMPOSED, compose_config, hydra_compose

VALUES = ["trainer.max_steps=7", "optimizer.lr=0.5", "optimizer.betas=[0.8,0.9]", "data.seq_len=32",
          "model.num_layers=3", "+trainer.new_key=1", "++trainer.max_steps=9", "logging.trackers=[mlflow]",
          "objective.beta=0.3", "deepspeed.offload_optimizer=cpu"]
BAD = ["trainer.max_steps=abc", "trainer.no_such_key=1", "+trainer.max_steps=3", "~trainer.no_such_key",
       "data=no_such_option", "data.path=[", "trainer.max_steps=1,2", "~logging.trackers",
       "optimizer.lr=${oc.env:NO_SUCH_VAR_EVER}"]  # the last is refused only when read: not at composition


def outcome(compose, overrides: list[str]):
    try:
        cfg = compose(overrides)
    except Exception as err:  # noqa: BLE001 - the refusal itself is what is compared
        return type(err).__name__, str(err), str(err.__cause__)
    return OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg)


SETS = [[], ["+preset=[smoke,fsdp]", "objective=grpo", *NEEDS["objective", "grpo"], *VALUES],
        ["data=chat", "trainer.max_steps=3", "data.path=x.jsonl", "model=hf", "model.name_or_path=m", *VALUES[:5]]]
SETS += [["+preset=smoke", "model=hf", bad] for bad in BAD]


@pytest.mark.parametrize("overrides", SETS, ids=[" ".join(s) for s in SETS])
def test_compose_config_is_one_whole_hydra_compose(overrides):
    COMPOSED.clear()
    first = outcome(lambda o: compose_config(o, check=False), overrides)  # composes the group choices
    again = outcome(lambda o: compose_config(o, check=False), overrides)  # from the process's copy
    assert first == again == outcome(lambda o: hydra_compose(o, False), overrides)  # every override at once
    assert (first[0] in ("ConfigCompositionException", "OverrideParseException", "MissingConfigException")) == (
        overrides[-1:] in ([b] for b in BAD[:-1]))  # each bad override is refused (the unset variable only when read)
    assert len(COMPOSED) <= 1


def test_group_choices_are_composed_once_for_every_set_of_values():
    COMPOSED.clear()
    for value in VALUES[:4]:
        compose_config(["+preset=smoke", "data=chat", value], check=False)
    assert len(COMPOSED) == 1
    assert compose_config(["+preset=smoke", "data=chat", "trainer.max_steps=7"], check=False).trainer.max_steps == 7
    assert compose_config(["+preset=smoke", "data=chat"], check=False).trainer.max_steps != 7  # the copy, not the cache
