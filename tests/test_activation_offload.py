"""Activation offloading (issue 28, item 2): the saved-tensor hooks move what the forward saves to
host memory and back, leaving the gradients bitwise as they were (with and without gradient
checkpointing, compiled too); a run with trainer.activation_offload=true on the CPU says once that
there is nothing to offload, trains, resumes exactly and exports a model that loads; the planner
moves the activations to host memory on a GPU.

Real parts: a tiny transformers Llama, torch's autograd hooks, the run itself. The CUDA stream path
is what scripts/gpu_check.sh measures on a lent GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import compose, read_metrics, train
from trainloop.memory.offload import OffloadHooks


def tiny_llama(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def gradients(model, ids, hooks=None) -> list[torch.Tensor]:
    model.zero_grad()
    if hooks is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with hooks:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_hooks_move_the_saved_tensors_and_leave_the_gradients_bitwise(checkpointing):
    model, ids = tiny_llama(checkpointing), torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    plain = gradients(model, ids)
    hooks = OffloadHooks()  # no stream: copies on the current device's stream, here the CPU
    offloaded = gradients(model, ids, hooks)
    assert hooks.offloaded > 2 * 32 * 64 * 4  # at least a few activations were copied out and back
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    if checkpointing:  # only what the checkpointed blocks keep is saved: far less than without
        uncheckpointed = OffloadHooks()
        gradients(tiny_llama(False), ids, uncheckpointed)
        assert hooks.offloaded < uncheckpointed.offloaded / 2


def test_the_hooks_run_under_torch_compile():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    compiled, x = torch.compile(model, backend="aot_eager"), torch.randn(32, 64)
    hooks = OffloadHooks()
    with hooks:
        compiled(x).square().sum().backward()
    offloaded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled(x).square().sum().backward()
    assert hooks.offloaded > 0 and all(torch.equal(a, p.grad) for a, p in zip(offloaded, model.parameters()))


@pytest.mark.slow
def test_a_cpu_run_says_once_there_is_nothing_to_offload_resumes_exactly_and_exports(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    run = ["trainer.activation_offload=true", "model.gradient_checkpointing=true", "trainer.max_steps=20",
           "trainer.eval_every=10", "trainer.log_every=2"]
    with caplog.at_level(logging.INFO, logger="trainloop"):
        straight = train(tmp_path / "straight", *run)
    assert caplog.text.count("nothing to offload") == 1
    stopped = tmp_path / "stopped"
    train(stopped, *run, "trainer.stop_at_step=10")
    train(stopped, *run)
    losses = [[(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(d) if "loss" in r or "eval_loss" in r]
              for d in (straight, stopped)]
    assert losses[0] == losses[1] and len(losses[0]) >= 12
    AutoModelForCausalLM.from_pretrained(stopped / "final")


def test_the_planner_keeps_offloaded_activations_in_host_memory_on_a_gpu():
    from trainloop.tools.plan import plan_memory
    from trainloop.tools.shape import model_shape

    cfg = compose("+preset=smoke", "trainer.activation_offload=true")
    on_gpu, on_cpu = plan_memory(cfg, model_shape(cfg), 1, "cuda"), plan_memory(cfg, model_shape(cfg), 1, "cpu")
    activations = next(x for x in on_gpu.lines if x.what == "activations")
    assert activations.where == "cpu" and "offloaded to pinned host memory" in activations.note
    assert 0 < on_gpu.get("activations in flight") < activations.bytes
    assert next(x for x in on_cpu.lines if x.what == "activations").where == "cpu"
    assert "activations in flight" not in {x.what for x in on_cpu.lines}
