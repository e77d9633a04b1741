"""Training objectives, one row each: what a step optimises and how it is evaluated.

The loop, the batch-size trials, the planner's measurement and the benchmarks all take their
loss from the objective the config names (`objective=NAME`), so a step is written once. A new
objective is one module with an Objective subclass (trainloop/objectives/base.py) and one row
here, plus conf/objective/NAME.yaml; docs/extending.md walks through it.
"""

from __future__ import annotations

from trainloop.objectives.base import BatchLoss, Objective
from trainloop.objectives.causal_lm import CausalLM
from trainloop.objectives.dpo import DPO
from trainloop.objectives.simpo import SimPO

OBJECTIVES: dict[str, type[Objective]] = {
    "causal_lm": CausalLM,
    "dpo": DPO,
    "simpo": SimPO,
}

__all__ = ["OBJECTIVES", "BatchLoss", "Objective", "build_objective", "problems", "read_only_by"]


def build_objective(cfg, device) -> Objective:
    """The objective the config names (`objective.name`, one of OBJECTIVES: trainloop.config checks it)."""
    return OBJECTIVES[cfg.objective.name](cfg, device)


def read_only_by() -> dict[str, tuple]:
    """config.read_only_by's rows for the objective.* keys: KEY -> (does this config read it?, who reads it)."""
    table = {}
    for key in dict.fromkeys(key for objective in OBJECTIVES.values() for key in objective.reads):
        readers = tuple(name for name, objective in OBJECTIVES.items() if key in objective.reads)
        table[key] = (lambda c, readers=readers: c.objective.name in readers, "objective=" + " or ".join(readers))
    return table


def problems(cfg, data_pairs: bool) -> list[str]:
    """The chosen objective's own checks, and whether the data (its format's `pairs`) is what it trains on."""
    objective = OBJECTIVES.get(cfg.objective.name)
    if objective is None:  # refused with the other choices
        return []
    problems = objective.problems(cfg)
    problems += loss_chunk_problems(cfg, objective)
    if objective.pairs and not data_pairs:
        problems.append(f"objective={objective.name} trains on preference pairs, and data={cfg.data.name} holds "
                        "none: set data=preference")
    if data_pairs and not objective.pairs:
        on_pairs = " or ".join(name for name, row in OBJECTIVES.items() if row.pairs)
        problems.append(f"data={cfg.data.name} holds preference pairs, which objective={objective.name} does not "
                        f"train on: set objective={on_pairs}")
    return problems


def loss_chunk_problems(cfg, objective: type[Objective]) -> list[str]:
    """trainer.loss_chunk_tokens: tokens per chunk (0: off), for an objective that reads it, on a
    model whose output layer is called once per forward (the chunked loss replaces its forward for
    the call: a whole-model compile would trace that and recompile every step)."""
    chunk = cfg.trainer.loss_chunk_tokens
    if chunk < 0:
        return [f"trainer.loss_chunk_tokens={chunk} must be 0 (the full logits) or the tokens per chunk"]
    if not chunk:
        return []
    problems = []
    if not objective.chunks_loss:
        readers = " or ".join(name for name, row in OBJECTIVES.items() if row.chunks_loss)
        problems.append(f"trainer.loss_chunk_tokens={chunk} is read by objective={readers} only for now "
                        f"(objective is {objective.name}): set trainer.loss_chunk_tokens=0")
    if cfg.compile.backend != "none" and not cfg.compile.regional:
        problems.append(f"trainer.loss_chunk_tokens={chunk} with compile={cfg.compile.backend} of the whole model: "
                        "the chunked loss swaps the output layer's forward for each call, which a whole-model "
                        "graph would trace and recompile; use compile.regional=true (the blocks only), or "
                        "trainer.loss_chunk_tokens=0")
    return problems
