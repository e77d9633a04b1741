"""Context parallelism (parallel.cp_size, issue 37) for real: 2 processes over gloo on CPU, each rank
holding half of every sequence, attention over the whole sequence by all-to-all, compared with one
process on the same global batch.

A rank that read other samples, a target not shifted across the slices' seam, a mask or position
applied to a slice instead of the whole row, a loss counted once per rank: each moves the losses
by far more than the 1e-5 every logged loss and gradient norm must keep here, over 8 steps (each is
wrong from the first step it touches).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import compose, conversation, grad_norms, read_metrics, reference_run, train, warm, write_rows
from trainloop.config.compose import ConfigError, validate

STEPS = 8
RUN = ["+preset=smoke", "data.seq_len=512", "data.batch_size=2", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
       "trainer.eval_every=4", "trainer.eval_batches=2", "logging.progress_bar=false", "checkpoint.every_steps=4",
       "checkpoint.keep_last=2"]
TOLERANCE = 1e-5
DATA = Path(__file__).resolve().parent / "data"
DPO = ["data=preference", "objective=dpo", "adapter=lora", f"data.path={DATA / 'preference.jsonl'}",
       "data.validation_fraction=0.2", "trainer.eval_batches=null", "optimizer=sgd", "optimizer.lr=0.5"]
GRPO = ["data=prompts", "objective=grpo", f"objective.rewards=[{DATA / 'grpo_rewards.py'}:letters]",
        f"data.path={DATA / 'prompts.jsonl'}", "objective.num_generations=4", "objective.max_new_tokens=6",
        "objective.num_iterations=2", "data.validation_fraction=0.2", "optimizer.lr=1e-2"]


def logged(run_dir: Path) -> list[tuple[int, str, float]]:
    """Every loss, gradient norm and evaluation value logged, by step."""
    keys = ("loss", "grad_norm", "reward", "kl", "clip_ratio", "rewards/margin", "eval_loss", "eval_reward",
            "rewards/accuracy")
    return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in keys
            if isinstance(r.get(key), float)]


def assert_same_run(got: Path, want: Path, steps: range = range(1, STEPS + 1)) -> None:
    a = [x for x in logged(got) if x[0] in steps]
    b = [x for x in logged(want) if x[0] in steps]
    assert [k[:2] for k in a] == [k[:2] for k in b] and {s for s, _, _ in a} == set(steps), (a, b)
    for (step, key, x), (_, _, y) in zip(a, b):
        assert x == pytest.approx(y, rel=TOLERANCE, abs=TOLERANCE), (step, key, x, y)
    assert len({x for _, key, x in a if key == "loss"}) > 1  # the model moved


def context_parallel(run_dir: Path, *overrides: str, processes: int = 2) -> Path:
    warm(processes, [*RUN, "parallel.cp_size=2", *overrides, f"hydra.run.dir={run_dir}"],
           cwd=run_dir.parent)
    assert {r["world_size"] for r in read_metrics(run_dir) if "world_size" in r} == {processes}
    return run_dir


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """One process on packed documents (each row's position ids restart per document)."""
    return reference_run(tmp_path_factory, *RUN)


@pytest.mark.slow
def test_packed_documents_split_in_two_train_as_one_process_and_resume_on_one(text, tmp_path):
    """cp=2 with gradient checkpointing (the blocks recompute their all-to-alls in the backward) and
    the chunked loss on each slice; then its step-4 checkpoint resumes on 1 process, and one
    process's on cp 2."""
    split = context_parallel(tmp_path / "cp2", "model.gradient_checkpointing=true", "trainer.loss_chunk_tokens=96")
    assert "sdpa with each packed document causal" in (split / "train.log").read_text()
    assert_same_run(split, text)
    assert grad_norms(split) and len(grad_norms(split)) == STEPS

    checkpoint = tmp_path / "saved"
    shutil.copytree(split / "checkpoints" / "step_0000004", checkpoint)
    resumed = train(tmp_path / "resumed", *RUN, f"checkpoint.resume={checkpoint}", small=False)
    assert_same_run(resumed, split, range(5, STEPS + 1))
    # and one process's step-4 checkpoint on cp 2
    one_process = text / "checkpoints" / "step_0000004"
    split_later = context_parallel(tmp_path / "cp2_resumed", f"checkpoint.resume={one_process}")
    assert_same_run(split_later, text, range(5, STEPS + 1))


@pytest.mark.slow
def test_fsdp2_over_four_processes_with_cp_2_trains_as_one_process(text, tmp_path):
    """FSDP2 shards over all four ranks (cp folded into the sharding, as torchtitan does); two
    context-parallel pairs each read a batch of 1: the global batch of 2."""
    split = context_parallel(tmp_path / "fsdp_cp2", "fsdp=full_shard", "data.batch_size=1", processes=4)
    assert_same_run(split, text)


@pytest.mark.slow
def test_tensor_parallel_2_x_cp_2_trains_as_one_process(tmp_path):
    """A dp x cp x tp mesh on 4 processes: each tp rank holds 2 of the 4 heads, and its cp pair
    swaps the sequence for 1 of those; FSDP2 shards over cp (folded into dp_shard)."""
    heads = ["model.num_heads=4"]
    one = train(tmp_path / "one", *RUN, *heads, small=False)
    split = context_parallel(tmp_path / "tp2_cp2", *heads, "fsdp=full_shard", "parallel.tp_size=2", processes=4)
    assert "2 dp_shard (1 dp x 2 cp) x 2 tp" in (split / "train.log").read_text()
    assert_same_run(split, one)


@pytest.mark.slow
def test_zero3_with_cp_2_trains_as_one_process_and_its_checkpoint_keeps_its_processes(text, tmp_path, deepspeed_ops):
    """DeepSpeed averages the gradients over every process, as DDP does; each rank's ZeRO-3 partition
    files hold its share, so its checkpoint resumes only as saved: cp 2 -> 1 is refused by name."""
    split = context_parallel(tmp_path / "zero3_cp2", "deepspeed=zero3", f"checkpoint.every_steps={STEPS}")
    assert_same_run(split, text)
    refused = warm(1, [*RUN, "deepspeed=zero3", f"hydra.run.dir={split}"], cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "parallel.cp_size: 2 -> 1" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
def test_chat_with_the_assistant_only_loss_and_fewer_key_value_heads_than_ranks(tmp_path):
    """One key/value head for 4 query heads: repeated to a head per query head before the swap."""
    rows = write_rows(tmp_path / "chat.jsonl", [{"messages": conversation(i)} for i in range(120)])
    chat = ["data=chat", f"data.path={rows}", "model.num_heads=4", "model.num_kv_heads=1"]
    one = train(tmp_path / "one", *RUN, *chat, small=False)
    assert_same_run(context_parallel(tmp_path / "cp2", *chat), one)


@pytest.mark.slow
def test_dpo_with_lora_sums_each_sequence_over_the_slices(tmp_path):
    """Chosen and rejected rows padded to a multiple of 2 and split; each sequence's log-probability
    summed over both slices before the loss; the chunked loss on each slice."""
    one = train(tmp_path / "one", *RUN, *DPO, "data.batch_size=4", small=False)
    assert_same_run(context_parallel(tmp_path / "cp2", *DPO, "data.batch_size=4", "trainer.loss_chunk_tokens=16"), one)


@pytest.mark.slow
def test_grpo_trains_on_the_completions_of_one_process(tmp_path):
    """The cp pair samples one process's completions (its data-parallel rank's seeds) on whole
    sequences; the training forward over prompt + completion (left-padded: its mask built for the
    whole row) is split. num_iterations=2: the second update's ratio and clipping are not 1."""
    one = train(tmp_path / "one", *RUN, *GRPO, small=False)
    assert_same_run(context_parallel(tmp_path / "cp2", *GRPO), one)


@pytest.mark.parametrize("overrides, says", [
    (["parallel.cp_size=3", "data.seq_len=64"], "parallel.cp_size=3 must divide data.seq_len=64"),
    (["parallel.cp_size=2", "model.num_heads=1", "model.hidden_size=64"], "must divide model.num_heads=1"),
    (["parallel.cp_size=2", "parallel.pp_size=2"], "with parallel.pp_size > 1"),
    (["parallel.cp_size=2", "parallel.tp_size=2", "fsdp=full_shard"],
     "parallel.cp_size=2 x parallel.tp_size=2 must divide model.num_heads=2"),
    (["parallel.cp_size=2", "parallel.tp_size=2", "fsdp=full_shard", "model.num_heads=4",
      "parallel.sequence_parallel=true"], "with parallel.sequence_parallel=true"),
    (["parallel.cp_size=2", "model.attn_implementation=eager"], "set model.attn_implementation=sdpa"),
    (["parallel.cp_size=2", "model.arch=mixtral"], "router's load-balancing loss"),
])
def test_what_cannot_split_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.").replace("(", r"\(")):
        validate(compose("+preset=smoke", *overrides))


def test_a_model_whose_heads_or_attention_cannot_split_is_refused():
    from transformers import LlamaConfig, MistralConfig

    from trainloop.parallel import check_context_model

    cfg = compose("+preset=smoke", "parallel.cp_size=2")
    check_context_model(cfg, LlamaConfig(num_attention_heads=4, hidden_size=64))
    with pytest.raises(ConfigError, match=r"must divide the model's attention heads \(3\)"):
        check_context_model(cfg, LlamaConfig(num_attention_heads=3, hidden_size=48))
    with pytest.raises(ConfigError, match="a sliding window"):
        check_context_model(cfg, MistralConfig(num_attention_heads=4, hidden_size=64, sliding_window=16))


def test_the_planner_gives_each_rank_its_slice_and_counts_the_all_to_alls():
    """A stream of tokens (no mask): the activations and the logits' gradients of a rank at cp=2 are
    those of half the sequence at cp=1; the model states are the strategy's (DDP: whole); the
    all-to-alls are four tensors of the slice forward and back, per block (measured: bench_parallel)."""
    from trainloop.tools.plan import plan_memory
    from trainloop.tools.shape import model_shape

    long = ["+preset=smoke", "data.packing=stream", "data.seq_len=2048", "model.max_position_embeddings=2048"]
    whole = compose(*long)
    half = compose(*long[:-2], "data.seq_len=1024", "model.max_position_embeddings=2048")
    split = compose(*long, "parallel.cp_size=2")
    plans = {name: plan_memory(cfg, model_shape(cfg), 2, "cpu") for name, cfg in
             (("whole", whole), ("half", half), ("split", split))}
    for what in ("activations", "logits' gradients", "parameters", "optimizer states"):
        assert plans["split"].get(what) == plans["half"].get(what), what
    assert plans["split"].get("activations") < 0.55 * plans["whole"].get("activations")
    shape, tokens = model_shape(split), split.data.batch_size * 1024
    assert plans["split"].sent("cp") == shape.num_layers * 2 * (tokens * 4 * shape.hidden * 4) // 2
    assert plans["whole"].sent("cp") == 0


def test_a_model_splits_its_sequences_only_where_its_group_is_installed_and_active():
    """The loss asks the model it runs for its group (trainloop.parallel.context.of): the policy and a frozen copy the
    strategy placed answer it, through a wrapper's .module too (DDP, DeepSpeed's engine), inside the group's active
    block alone (nested blocks stay split until the outer ends); a model it was not installed on answers None."""
    import torch

    from trainloop.parallel.context import ContextParallel, of

    cp, policy, other = ContextParallel(None, 2, 0), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    wrapped = torch.nn.Module()
    wrapped.module = policy
    assert cp.install(wrapped) is wrapped
    assert of(wrapped) is None and of(policy) is None
    with cp.active():
        assert of(wrapped) is cp and of(policy) is cp and of(other) is None
        with cp.active():
            assert of(policy) is cp
        assert of(policy) is cp
    assert of(policy) is None
