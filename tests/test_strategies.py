"""The strategy table (issue 24): each row is chosen by the config users already write, answers
the data-parallel size everything above it reads, and states its own config problems. The rows'
training behaviour is tested where each strategy is (test_distributed, test_deepspeed_config,
test_fsdp, test_resume); a new row adds its config here."""

from __future__ import annotations

import pytest

from helpers import compose, reset_accelerate
from trainloop.config.compose import validate
from trainloop.parallel import STRATEGIES, build_strategy, chosen, problems

# A config that chooses each row (a new row adds its own).
CHOOSE = {"ddp": [], "zero": ["+preset=zero2"], "fsdp2": ["+preset=fsdp"], "hsdp": ["+preset=hsdp"],
          "fsdp2_tp": ["+preset=tp"], "fsdp2_ep": ["+preset=ep", "model.arch=mixtral"],
          "pipeline": ["parallel.pp_size=2", "model.tie_embeddings=false", "trainer.gradient_accumulation_steps=2"]}
# tensor parallelism needs tp_size processes, expert parallelism ep_size (tests/test_expert_parallel.py), a pipeline
# pp_size (tests/test_pipeline.py), hybrid sharding dp_replicate groups of 2 or more (tests/test_hsdp.py)
ONE_PROCESS = sorted(set(STRATEGIES) - {"fsdp2_tp", "fsdp2_ep", "pipeline", "hsdp"})


def test_every_strategy_is_chosen_by_a_config():
    assert set(STRATEGIES) == set(CHOOSE)
    for name, overrides in CHOOSE.items():
        cfg = compose(*overrides)
        validate(cfg)
        assert chosen(cfg) == name


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_one_process_is_one_data_parallel_rank(name):
    from accelerate import Accelerator

    reset_accelerate()
    strategy = build_strategy(compose(*CHOOSE[name]), Accelerator(cpu=True))
    assert isinstance(strategy, STRATEGIES[name])
    assert (strategy.world_size, strategy.dp_size, strategy.dp_rank) == (1, 1, 0)
    assert not strategy.builds_on_meta()  # the one process builds the weights itself


@pytest.mark.parametrize("overrides, says", [
    (["+preset=fsdp", "deepspeed=zero2"], "a run shards with FSDP2 or with DeepSpeed ZeRO, not both"),
    (["+preset=fsdp", "precision=fp16"], "fsdp=full_shard with precision=fp16"),
    (["+preset=zero3", "compile=inductor"], "compile.backend with DeepSpeed is not supported"),
    (["deepspeed.offload_optimizer=cpu"], "needs DeepSpeed: choose deepspeed=zero1, zero2 or zero3"),
    (["parallel.tp_size=2"], "parallel.tp_size=2 with fsdp=none"),
    (["+preset=tp", "deepspeed=zero2"], "parallel.tp_size=2 with deepspeed.stage=2"),
])
def test_each_strategy_states_its_own_problems(overrides, says):
    found = problems(compose(*overrides))
    assert any(says in p for p in found), found
    assert problems(compose()) == []


def test_tensor_and_expert_parallel_on_one_process_are_refused_naming_the_key():
    """tp_size and ep_size must divide the processes: checked when the strategy is built, before any model."""
    from accelerate import Accelerator

    from trainloop.errors import ConfigError

    reset_accelerate()
    with pytest.raises(ConfigError, match=r"parallel\.tp_size=2 does not divide the 1 process"):
        build_strategy(compose("+preset=tp"), Accelerator(cpu=True))
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"parallel\.ep_size=2 does not divide the 1 process"):
        build_strategy(compose(*CHOOSE["fsdp2_ep"]), Accelerator(cpu=True))
