"""The frozen reference the objectives that keep one share (dpo, kto, grpo with objective.beta > 0; distill's
teacher is held the same way): the policy with its adapters disabled where it has them, else a frozen copy of
the model as built, which the strategy places like the policy (Strategy.prepare_frozen); the planner's line for
such a copy, and the start-up line saying how the ranks hold it."""

from __future__ import annotations


def reference_model(model):
    """The peft model under a data-parallel wrapper (DDP's .module), whose adapters can be disabled."""
    return model if hasattr(model, "disable_adapter") else model.module


def plan_copy(plan, who: str) -> None:
    """The planner's line for a frozen copy of the model: the policy's parameters once more, held
    as the strategy holds them (whole, partitioned by ZeRO-3, sharded by FSDP2), in its precision."""
    from trainloop.parallel.memory import Line

    for x in [x for x in plan.lines if x.what == "parameters"]:
        plan.lines.append(Line("reference model", x.bytes, x.where, exact=x.exact,
                               note=f"{who}: a frozen copy of the parameters, held like them"))


def held(frozen) -> str:
    """How the ranks hold a frozen copy, read back from it (FSDP2's DTensors, DeepSpeed's engine)."""
    from trainloop.model.tensors import is_fsdp2

    if is_fsdp2(frozen):
        return "sharded by FSDP2 like the policy"
    if hasattr(frozen, "zero_optimization_stage"):
        stage = frozen.zero_optimization_stage()
        return f"partitioned by DeepSpeed ZeRO-{stage} like the policy" if stage == 3 else \
            "whole on each rank (a DeepSpeed engine without ZeRO: the policy's stage partitions no parameters)"
    return "whole on each rank"
