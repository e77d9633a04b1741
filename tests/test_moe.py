"""Mixture of Experts (model.arch=mixtral): the router's load-balancing loss trains, its metrics are
the router's real choices, and the model trains, exports and generates on 1 and 2 processes.

The load-balancing loss is transformers' (Switch Transformer's) over one forward's tokens: a product
of per-batch means, so it does not split over samples. 2 processes at batch 4 therefore equal 1
process at batch 4 with 2 accumulation steps (the same micro-batches of the same global batch,
trainloop.data.order), not 1 process at batch 8.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import (
    ZERO_TOLERANCE, assert_samples_are_the_final_models, clean_env, compose, read_metrics, reference_run, train,
    warm,
)

MOE = ["+preset=smoke", "model.arch=mixtral", "model.num_experts=4"]
STEPS = 20
# a coefficient large enough that balancing visibly acts within 20 steps (HF's default 0.001 barely does)
RUN = [f"trainer.max_steps={STEPS}", "trainer.log_every=1", f"trainer.eval_every={STEPS}", "trainer.eval_batches=2",
       "logging.progress_bar=false", "checkpoint.keep_last=1", "model.router_aux_loss_coef=0.1",
       "eval.prompts=['The ']", "eval.max_new_tokens=8"]  # every rank generates together (trainloop.observe.samples)
TOLERANCE = 1e-5  # fp32 DDP against the 1-process run of the same micro-batches


def train_lines(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """1 process, batch 4, 2 accumulation steps: the micro-batches 2 processes at batch 4 see."""
    return reference_run(tmp_path_factory, *MOE, *RUN, "trainer.gradient_accumulation_steps=2")


def assert_router_metrics(run_dir: Path, num_experts: int = 4) -> list[dict]:
    lines = train_lines(run_dir)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for r in lines:
        assert math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0, r
        share = r["expert_token_share"]
        assert len(share) == num_experts and all(0 <= s <= 1 for s in share), r
        assert sum(share) == pytest.approx(1, abs=1e-9)
    assert not any("aux_loss" in r for r in read_metrics(run_dir) if "eval_loss" in r)  # eval: the token loss
    return lines


def assert_final_generates(run_dir: Path, cfg) -> None:
    """final/ is a Mixtral with the run's experts and the planner's parameter count, and it generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainloop.tools.shape import model_shape

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert type(model).__name__ == "MixtralForCausalLM"
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (4, 2)
    assert sum(p.numel() for p in model.parameters()) == model_shape(cfg).num_params
    prompt = tokenizer("The", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8


def assert_final_equals(run_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    """The exported weights, loaded back (transformers converts Mixtral's per-expert checkpoint
    layout to stacked experts), equal the trained ones (live names, from the last checkpoint)."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    assert any(".experts.gate_up_proj" in k for k in weights)
    assert set(weights) <= set(exported)
    different = [k for k in weights if not torch.equal(weights[k].float(), exported[k])]
    assert not different, f"{len(different)} tensors differ from the trained ones, e.g. {different[:3]}"


def checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step_{STEPS:07d}" / "model.safetensors")


def test_router_metrics_are_the_routers_choices():
    """RouterLoad's token counts are the top-k experts the Mixtral blocks really used, and its
    aux is transformers' load-balancing loss of that forward."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from trainloop.data.loaders import build_tokenizer
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives.causal_lm import CausalLM
    from trainloop.model.router import RouterLoad

    cfg = compose(*MOE)
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(build_tokenizer(None, None))))
    chosen = []
    for layer in model.model.layers:  # the router returns (logits, scores, indices)
        layer.mlp.gate.register_forward_hook(lambda m, args, out: chosen.append(out[2].flatten()))
    objective = CausalLM(cfg, "cpu")  # the loop's loss, which records each training forward's routing
    router = objective.router
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    objective.batch_loss(model, {"input_ids": ids, "labels": ids})

    expected = torch.bincount(torch.cat(chosen), minlength=4).double()
    assert expected.sum() == 2 * 3 * 16 * cfg.model.num_layers  # every token, top 2, every layer
    assert router.tokens.tolist() == expected.tolist()
    logits = model(input_ids=ids).router_logits
    assert router.aux.item() == pytest.approx(load_balancing_loss_func(logits, 4, 2).item(), rel=1e-6)
    assert router.aux.requires_grad  # it is backpropagated by the loop
    assert RouterLoad.for_model(compose("+preset=smoke").model, "cpu") is None  # a dense model has no router


def test_experts_without_tokens_still_get_a_gradient():
    """What DDP needs without find_unused_parameters: 3 tokens, 8 experts, top 1, so at least 5
    experts per block get no token; the stacked expert weights still all get a gradient."""
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives.causal_lm import CausalLM

    cfg = compose(*MOE, "model.num_experts=8", "model.experts_per_token=1")
    model = build_model(cfg.model, build_model_config(cfg.model, 320))
    objective = CausalLM(cfg, "cpu")
    router = objective.router
    ids = torch.tensor([[5, 7, 9]])
    summed = objective.batch_loss(model, {"input_ids": ids, "labels": ids}).summed
    (summed + router.coef * router.aux).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    idle = [e for e in range(8) if router.tokens[e] == 0]  # in every block: 3 tokens x 2 blocks < 8
    assert len(idle) >= 2
    for layer in model.model.layers:  # an idle expert's gradient slice is there, and zero
        assert layer.mlp.experts.gate_up_proj.grad[idle].abs().sum() == 0
        assert layer.mlp.experts.down_proj.grad.abs().sum() > 0


@pytest.mark.parametrize("key,value,field", [("num_experts", 3, "num_local_experts"),
                                             ("experts_per_token", 1, "num_experts_per_tok"),
                                             ("router_aux_loss_coef", 0.5, "router_aux_loss_coef")])
def test_the_expert_keys_shape_the_model_and_its_router(key, value, field):
    """Each expert key reaches the Mixtral config (written to final/) and the loop's router.
    (test_ignored_keys checks that they are refused without model.arch=mixtral.)"""
    from trainloop.model.builder import build_model_config
    from trainloop.model.router import RouterLoad

    cfg = compose(*MOE, f"model.{key}={value}")
    config = build_model_config(cfg.model, 320)
    assert getattr(config, field) == value != getattr(build_model_config(compose(*MOE).model, 320), field)
    router = RouterLoad.for_model(cfg.model, "cpu")
    assert (router.num_experts, router.top_k, router.coef) == (
        cfg.model.num_experts, cfg.model.experts_per_token, cfg.model.router_aux_loss_coef)


@pytest.mark.slow
def test_one_process_trains_balances_exports_and_generates(one_process, tmp_path):
    lines = assert_router_metrics(one_process)
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.3
    assert_final_generates(one_process, compose(*MOE))
    assert_final_equals(one_process, checkpoint_weights(one_process))

    # the loss is backpropagated: without it the router collapses onto fewer experts
    unbalanced = assert_router_metrics(train(tmp_path, *MOE, *RUN, "trainer.gradient_accumulation_steps=2",
                                             "model.router_aux_loss_coef=0", "checkpoint.save_final_model=false",
                                             small=False))
    last = slice(-5, None)
    mean_aux = [sum(r["aux_loss"] for r in run[last]) / 5 for run in (lines, unbalanced)]
    assert mean_aux[0] < mean_aux[1], mean_aux
    assert min(lines[-1]["expert_token_share"]) > min(unbalanced[-1]["expert_token_share"])


# strategy: (what the run log says runs, tolerance of the losses against 1 process)
STRATEGIES = {
    "ddp": ("DistributedType.MULTI_CPU (2 process(es)", TOLERANCE),
    "zero3": ("DeepSpeed ZeRO-3 engaged (DistributedType.DEEPSPEED, 2 process(es)", ZERO_TOLERANCE),
    "fsdp": ("FSDP2 full_shard over 2 shard(s)", TOLERANCE),
}
WEIGHT_TOLERANCE = {"ddp": 1e-4, "zero3": 1e-2, "fsdp": 1e-4}  # per tensor, as test_fsdp measures it


def launch_two(tmp_path: Path, strategy: str) -> Path:
    run_dir = tmp_path / "run"
    warm(2, [*MOE[1:], f"+preset=[smoke,{strategy}]", *RUN, f"hydra.run.dir={run_dir}"],
         cwd=tmp_path, env=clean_env(DS_ACCELERATOR="cpu"))
    return run_dir


def assert_matches(run_dir: Path, reference: Path, tolerance: float) -> None:
    got, want = train_lines(run_dir), train_lines(reference)
    for key in ("loss", "aux_loss"):
        worst = max(abs(g[key] - w[key]) / abs(w[key]) for g, w in zip(got, want))
        print(f"{run_dir}: {key} within {worst:.1e} of 1 process")
        assert worst < tolerance, f"{key}: largest relative difference {worst:.2e} (tolerance {tolerance:.0e})"


def relative_difference(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp(min=1e-12)).item() for k in want)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_like_one_with_the_same_micro_batches_and_export(tmp_path, one_process, strategy):
    two_processes_train_like_one(tmp_path, one_process, strategy)


@pytest.mark.slow
def test_two_processes_under_zero3_train_like_one_and_export(tmp_path, one_process, deepspeed_ops):
    """The same under ZeRO-3; the deepspeed_ops fixture has conftest run it with the DeepSpeed tests, last."""
    two_processes_train_like_one(tmp_path, one_process, "zero3")


def two_processes_train_like_one(tmp_path: Path, one_process: Path, strategy: str) -> None:
    """Acceptance 7: DDP, ZeRO-3 and FSDP2 on 2 processes at batch 4 give the 1-process losses, aux
    losses and tokens per expert of the same micro-batches (batch 4, 2 accumulation steps), and
    final/ loads as a Mixtral, generates and holds the trained weights; the samples every rank
    generated together at the last evaluation are final/'s own greedy completions."""
    from transformers import AutoModelForCausalLM

    engaged, tolerance = STRATEGIES[strategy]
    run_dir = launch_two(tmp_path, strategy)
    log = (run_dir / "train.log").read_text()
    assert engaged in log and "(0.45M trained; 4 experts per block, 2 per token)" in log, log[-2000:]
    assert {r["world_size"] for r in read_metrics(run_dir)} == {2}
    lines = assert_router_metrics(run_dir)
    assert_matches(run_dir, one_process, tolerance)
    if strategy != "zero3":  # the tokens per expert, summed over both ranks, are the 1-process counts
        reference = train_lines(one_process)
        assert max(abs(a - b) for g, w in zip(lines, reference)
                   for a, b in zip(g["expert_token_share"], w["expert_token_share"])) < 1e-9
    assert_final_generates(run_dir, compose(*MOE))
    assert_samples_are_the_final_models(run_dir, ["The "], 8)  # issue 17, check 5
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    one = AutoModelForCausalLM.from_pretrained(one_process / "final").state_dict()
    assert set(final) == set(one)
    worst = relative_difference(final, one)
    print(f"{strategy}: final weights within {worst:.1e} of 1 process")
    assert worst < WEIGHT_TOLERANCE[strategy]
    if strategy == "ddp":  # exactly the trained weights (DDP's checkpoint holds them whole)
        assert_final_equals(run_dir, checkpoint_weights(run_dir))
    if strategy == "zero3":  # exactly DeepSpeed's own consolidation of its checkpoint
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        checkpoint = run_dir / "checkpoints" / f"step_{STEPS:07d}"
        assert_final_equals(run_dir, get_fp32_state_dict_from_zero_checkpoint(str(checkpoint)))


@pytest.mark.slow
def test_tp2_splits_the_attention_keeps_the_experts_whole_and_trains_like_one_process(tmp_path, one_process):
    """Tensor parallelism on a mixture (issue 27 item 1): tp=2 on 2 processes, one data-parallel
    rank at batch 4 with 2 accumulation steps (one_process's micro-batches), splits each block's
    q/k/v column-wise and o row-wise and keeps the router and the experts whole on each tp rank:
    the first 10 losses, aux losses and tokens per expert are the 1-process ones. Ranks of a tp
    group that routed different tokens, or experts split as if they were one MLP, are far off."""
    run_dir = tmp_path / "run"
    warm(2, [*MOE[1:], "+preset=[smoke,tp]", *RUN, "trainer.gradient_accumulation_steps=2",
            "trainer.stop_at_step=10", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert ("FSDP2 x TP: mesh cpu 1 dp_shard x 2 tp, 8 linear layers split column-/row-wise over tp (attention "
            "only: the routed experts layers.*.mlp.experts and the router whole on each tp rank)"
            in (run_dir / "train.log").read_text())
    lines, reference = train_lines(run_dir), train_lines(one_process)
    assert [r["step"] for r in lines] == list(range(1, 11))
    assert_matches(run_dir, one_process, TOLERANCE)  # the first 10 steps (zip)
    assert max(abs(a - b) for g, w in zip(lines, reference)
               for a, b in zip(g["expert_token_share"], w["expert_token_share"])) < 1e-9


def test_the_export_check_counts_the_experts_written_in_the_checkpoint_layout(one_process, tmp_path):
    """final/ names Mixtral's experts per expert (w1/w2/w3), not as the live model stacks them: the
    check accepts that only if the elements add up, so a dropped expert tensor still fails it."""
    from safetensors.torch import load_file, save_file

    from trainloop.data.loaders import build_tokenizer
    from trainloop.export import check_export, live_shapes
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose(*MOE)
    live = live_shapes(build_model(cfg.model, build_model_config(cfg.model, len(build_tokenizer(None, None)))))
    assert check_export(one_process / "final", live) == sum(math.prod(s) for s in live.values())
    written = load_file(one_process / "final" / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in written
    del written["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    save_file(written, tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="missing"):
        check_export(tmp_path, live)
