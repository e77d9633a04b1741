"""Every objective on every layout (issue 59): scripts/matrix.py runs the whole table; these are the cells it
gained, on warm ranks, each 10 steps against one process within 1e-5 (every loss, gradient norm,
objective metric and evaluation value metrics.jsonl holds), and its comparison shown to catch a difference.

Tensor parallelism keeps the embeddings, the output layer and the loss whole on every rank of a tp group, so
the objectives that need more than a next-token loss (per-row log-probabilities, a frozen copy split like the
model, generation) run there as on one process: dpo with a full-model reference, grpo generating on both tp
ranks together, distill with its teacher split like the student."""

from __future__ import annotations

import pytest

from helpers import DATA, TEACHER, reference_run, run_log, script, warm

matrix = script("matrix")


# the cells that ran refused before issue 59's check 1: tensor parallelism for every objective beyond causal_lm,
# context parallelism for kto, distill and reward, the pipeline for every objective (it runs the forwards an
# objective's loss reads without gradients through the stages first: a frozen reference or teacher cut into them,
# kto's mismatched pairs; reward's score head sits on the last stage; grpo generates through the stages)
# And grpo on 2 data-parallel ranks, which sampled other completions than one process before each row drew from
# its own key (objectives/generation.py's RowDraws; ZeRO-3, FSDP2 and HSDP sample as DDP does: scripts/matrix.py)
NEW_CELLS = [*((objective, "FSDP2 x TP") for objective in ("dpo", "simpo", "orpo", "reward", "kto", "grpo", "distill")),
             *((objective, "context parallel") for objective in ("kto", "distill", "reward")),
             *((objective, "pipeline") for objective in ("simpo", "orpo", "dpo", "kto", "reward", "grpo", "distill")),
             ("grpo", "DDP")]
SAYS = {"DDP": "DistributedType.MULTI_CPU (2 process(es)", "FSDP2 x TP": "FSDP2 x TP: mesh cpu 1 dp_shard x 2 tp",
        "context parallel": "context parallel: 2 processes split each sequence",
        "pipeline": "pipeline: 2 stages over 2 processes (1f1b)"}


@pytest.mark.slow
@pytest.mark.parametrize("objective, layout", NEW_CELLS, ids=[f"{o}-{l.replace(' ', '_')}" for o, l in NEW_CELLS])
def test_the_objective_trains_on_the_layout_as_one_process_does(objective, layout, tmp_path_factory, tmp_path):
    run_dir = the_cell_runs_as_one_process(objective, layout, [], tmp_path_factory, tmp_path)
    if layout == "pipeline" and objective in ("dpo", "distill"):  # a full fine-tune's reference, the teacher
        assert "cut into the pipeline's stages like the policy" in run_log(run_dir), run_log(run_dir)[-2000:]


@pytest.mark.slow
def test_on_policy_distill_generates_through_the_pipeline_as_one_process_does(tmp_path_factory, tmp_path):
    """The student completes each prompt through the stages (Pipeline.generator) on padded chat rows."""
    on_policy = ["data=chat", f"data.path={DATA / 'chat.jsonl'}", "data.packing=none", "objective.on_policy_fraction=1",
                 "objective.max_new_tokens=8"]
    run_dir = the_cell_runs_as_one_process("distill", "pipeline", on_policy, tmp_path_factory, tmp_path)
    assert '"on_policy_share": 1.0' in (run_dir / "metrics.jsonl").read_text()


def the_cell_runs_as_one_process(objective: str, layout: str, extra: list[str], tmp_path_factory, tmp_path):
    """The layout's run of the objective (with `extra` on both sides) on warm ranks, against one process: the
    run dir."""
    base = matrix.one_process(objective, layout, str(TEACHER))
    want = matrix.numbers(reference_run(tmp_path_factory, *base, *extra))
    processes, overrides = matrix.cell(objective, layout, str(TEACHER))
    run_dir = tmp_path / "run"
    warm(processes, [*overrides, *extra, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert SAYS[layout] in run_log(run_dir), run_log(run_dir)[-2000:]
    first, worst = matrix.difference(matrix.numbers(run_dir), want)
    assert first is None, f"{objective} under {layout}: {first}"
    assert len({v for _, _, key, v in want if key == "loss"}) > 1  # the model moved
    return run_dir


def test_the_comparison_names_a_value_past_the_tolerance_and_a_key_that_differs():
    want = [(0, 1, "loss", 2.0), (0, 1, "grad_norm", 0.5), (1, 2, "loss", 200.0)]
    assert matrix.difference(want, want) == (None, 0.0)
    close = [(0, 1, "loss", 2.0 + 1e-5), (0, 1, "grad_norm", 0.5 + 9e-6), (1, 2, "loss", 200.0 + 1e-3)]
    assert matrix.difference(close, want)[0] is None  # within 1e-5 of the value, or 1e-5 below 1
    off = [(0, 1, "loss", 2.0), (0, 1, "grad_norm", 0.5 + 2e-5), (1, 2, "loss", 200.0)]
    assert matrix.difference(off, want)[0] == "step 1 grad_norm: 0.50002 against 0.5"
    other = [(0, 1, "loss", 2.0), (0, 1, "kl", 0.5), (1, 2, "loss", 200.0)]
    assert matrix.difference(other, want)[0].startswith("logged other keys or steps (line 0: (1, 'kl')")
    assert matrix.difference(want[:2], want)[0] == "logged other keys or steps (2 numbers against 3)"


def test_every_cell_of_the_table_is_one_the_reference_table_names():
    """The script's layouts are the config reference's objective x layout columns, and its objectives every row
    of trainloop.objectives, plus chat."""
    from trainloop.objectives import OBJECTIVES
    from trainloop.tools.reference import LAYOUTS

    assert set(matrix.LAYOUTS) == set(LAYOUTS)
    assert set(matrix.OBJECTIVES) == {*OBJECTIVES, "chat"}
    for layout, (_, overrides, _, model) in matrix.LAYOUTS.items():
        assert set(LAYOUTS[layout]) <= set(overrides + model), layout  # the same layout, the batch aside
