"""The frozen reference the objectives that keep one share (dpo, kto, grpo with objective.beta > 0; distill's
teacher is held the same way): the policy with its adapters disabled where it has them, else a frozen copy of
the model as built, which the strategy places like the policy (Strategy.prepare_frozen); the planner's line for
such a copy."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext


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


@contextmanager
def as_reference(model, adapted: bool):
    """The policy as its own reference for the length of the block: eval mode, no gradients, its adapters disabled
    (`adapted`; without adapters the policy is its reference only before its first step)."""
    import torch

    training = model.training
    model.eval()
    try:
        with torch.no_grad(), reference_model(model).disable_adapter() if adapted else nullcontext():
            yield
    finally:
        model.train(training)


@contextmanager
def reference_forward(model, frozen, adapted: bool = True):
    """The model a reference forward runs on, for the length of the block, without gradients: the frozen copy,
    or the policy as its own reference (as_reference)."""
    import torch

    if frozen is not None:
        with torch.no_grad():
            yield frozen
    else:
        with as_reference(model, adapted):
            yield reference_model(model)
