"""Training objectives, one row each: what a step optimises and how it is evaluated.

The loop, the batch-size trials, the planner's measurement and the benchmarks all take their
loss from the objective the config names (`objective=NAME`), so a step is written once. A new
objective is one module with an Objective subclass (trainloop/objectives/base.py) and one row
here, plus conf/objective/NAME.yaml; docs/extending.md walks through it.
"""

from __future__ import annotations

from trainloop.objectives.base import BatchLoss, Objective
from trainloop.objectives.causal_lm import CausalLM

OBJECTIVES: dict[str, type[Objective]] = {
    "causal_lm": CausalLM,
}

__all__ = ["OBJECTIVES", "BatchLoss", "Objective", "build_objective"]


def build_objective(cfg, device) -> Objective:
    """The objective the config names (`objective.name`, one of OBJECTIVES: trainloop.config checks it)."""
    return OBJECTIVES[cfg.objective.name](cfg, device)
