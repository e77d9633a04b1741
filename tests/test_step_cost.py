"""What the loop itself dispatches per optimizer step (issue 60, item 5).

Where the host bounds the step (a small model on any GPU), each aten op trainloop runs around the model
costs about as much as one of the model's own: a launch on a GPU, a dispatch here. A run in this process
counts, with a TorchDispatchMode, the ops of each iteration of the loop that run outside any module's
forward, outside the backward (trainloop.parallel.base.Strategy.backward) and outside the optimizer's step:
the loss, the step's units, the guard, clipping, the loop's own sums. The counts are held to what issue 60
left; a new op in the step fails here with the list of what runs. And the model and the loss compile without a
graph break, which would split the step into more graphs and run Python between them.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import train
from trainloop import loop
from trainloop.parallel.base import Strategy

# ops per iteration outside forward, backward and the optimizer's step (one micro-batch, causal_lm, a for-loop
# AdamW, clipping at 1.0): a quiet step, and one that writes a log line
QUIET_OPS = 37
LOGGED_OPS = 40


class LoopOps(TorchDispatchMode):
    """The aten ops of each iteration of the loop (set by the patched train_step), but those inside a module's
    forward, the backward or the optimizer's step (depth > 0)."""

    def __init__(self):
        super().__init__()
        self.iteration, self.depth = 0, 0
        self.ops: dict[int, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0 and self.iteration:
            self.ops.setdefault(self.iteration, Counter())[str(func)] += 1
        return func(*args, **(kwargs or {}))


def counted(tmp_path, monkeypatch, *overrides: str) -> LoopOps:
    counter, real_step, real_backward = LoopOps(), loop.train_step, Strategy.backward

    def step(*args, **kwargs):
        counter.iteration += 1
        return real_step(*args, **kwargs)

    def backward(self, loss):
        counter.depth += 1
        try:
            real_backward(self, loss)
        finally:
            counter.depth -= 1

    def enter(*args):
        counter.depth += 1

    def leave(*args):
        counter.depth -= 1

    monkeypatch.setattr(loop, "train_step", step)
    monkeypatch.setattr(Strategy, "backward", backward)
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(lambda *args: leave()),
             register_optimizer_step_pre_hook(enter),
             register_optimizer_step_post_hook(leave)]
    try:
        with counter:
            train(tmp_path / "run", "trainer.max_steps=6", "trainer.log_every=3", "trainer.eval_every=6",
                  "checkpoint.save_final_model=false", "model.num_layers=1", "trainer.eval_batches=1",
                  "optimizer=adamw", "optimizer.impl=for_loop", "trainer.max_grad_norm=1.0", *overrides)
    finally:
        for hook in hooks:
            hook.remove()
    return counter


def test_the_loop_dispatches_few_ops_around_the_model(tmp_path, monkeypatch):
    """Iterations 1, 2, 4 and 5 only step; 3 writes a log line too (6 evaluates and saves). Every quiet
    iteration dispatches the same ops."""
    ops = counted(tmp_path, monkeypatch, "data.packing=stream").ops
    quiet = [ops[n] for n in (2, 4, 5)]  # the first also starts the data loader's epoch
    assert all(q == quiet[0] for q in quiet), quiet
    listing = "\n".join(f"  {n} {op}" for op, n in sorted(quiet[0].items()))
    assert sum(quiet[0].values()) <= QUIET_OPS, f"{sum(quiet[0].values())} ops in a step, not <= {QUIET_OPS}:\n{listing}"
    assert sum(ops[3].values()) <= LOGGED_OPS, ops[3]
    # the count sees ops: the loss's cross-entropy runs outside the model's forward
    assert any("cross_entropy" in op or "nll_loss" in op for op in quiet[0]), listing


@pytest.mark.parametrize("overrides", [["data.packing=stream"], ["data.packing=documents"],
                                       ["data.packing=documents", "compile.regional=true", "trainer.loss_chunk_tokens=32"]],
                         ids=["stream", "documents", "blocks, chunked loss"])
def test_the_model_and_the_loss_compile_without_a_graph_break(tmp_path, overrides):
    """compile=eager (TorchDynamo's capture, run eagerly: the graphs inductor would compile, without its code
    generation) with compile.fullgraph=true, which fails at any break: the model's forward with trainloop's
    attention functions, and the loss (with the chunked loss, whose output layer changes per call, the blocks
    compile alone: compile.regional, as the config requires). Dynamo's own counter says the same. The
    optimizer's step is left eager here: torch's breaks its graph on purpose (tests/test_efficiency.py compiles it)."""
    from torch._dynamo.utils import counters

    counters.clear()
    run = train(tmp_path / "run", "compile=eager", "compile.fullgraph=true", "compile.optimizer=false",
                "trainer.max_steps=2", "trainer.eval_every=2", "checkpoint.save_final_model=false",
                "model.num_layers=1", *overrides)
    assert "step" in (run / "metrics.jsonl").read_text()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0  # the count sees what was captured
