"""eval.harness and `python -m trainloop.evaluate`: EleutherAI's lm-evaluation-harness on real runs.

The score a run logs at its end is compared with what the harness's own command line gives on the
run's final/ (`lm_eval --model hf ...`, a subprocess), and with `python -m trainloop.evaluate`, on
the shipped tasks (examples/harness). The 2-process FSDP2 scores (with LoRA, against the merged
export) are in tests/test_fsdp.py, beside the run they share.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import REPO, compose, launch, panels, read_metrics, reference_run, train

SHIPPED = REPO / "examples" / "harness"
LIMIT = 60  # documents per task: the harness's numbers are compared, not the model's quality
HARNESS = ["eval.harness.tasks=[pydoc_order,pydoc_words]", f"eval.harness.limit={LIMIT}"]
TOLERANCE = 1e-6


def harness_lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if "/" in k or k == "step"} for r in read_metrics(run_dir)
            if r.get("event") == "harness"]


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> Path:
    """A smoke run of 20 steps scored at steps 10 and 20 (the last)."""
    return reference_run(tmp_path_factory, "+preset=smoke", *HARNESS, "eval.harness.every=10")


@pytest.mark.slow
def test_the_score_at_the_end_is_lm_evals_command_on_final(scored, tmp_path):
    """Acceptance 1 and 3: the harness's own command line on final/, and trainloop.evaluate, give the logged numbers."""
    from trainloop.tools.evaluate import main

    lines = harness_lines(scored)
    assert [line["step"] for line in lines] == [10, 20]
    logged = lines[-1]
    assert {"pydoc_order/acc", "pydoc_order/acc_norm", "pydoc_order/acc_stderr", "pydoc_words/exact_match"} \
        <= set(logged)

    out = tmp_path / "lm_eval"
    launch([str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
            f"pretrained={scored / 'final'},dtype=float32", "--device", "cpu", "--include_path", str(SHIPPED),
            "--tasks", "pydoc_order", "--limit", str(LIMIT), "--output_path", str(out)], cwd=tmp_path)
    (result_file,) = out.rglob("results_*.json")
    theirs = json.loads(result_file.read_text())["results"]["pydoc_order"]
    for metric in ("acc", "acc_norm"):
        assert abs(logged[f"pydoc_order/{metric}"] - theirs[f"{metric},none"]) <= TOLERANCE, (metric, logged, theirs)

    written = tmp_path / "evaluate.json"
    main([str(scored), "--tasks", "pydoc_order,pydoc_words", "--limit", str(LIMIT), "--output", str(written)])
    ours = json.loads(written.read_text())["results"]
    for key, value in logged.items():
        if key != "step":
            task, metric = key.split("/")
            assert abs(ours[task][f"{metric},none"] - value) <= TOLERANCE, (key, value, ours[task])


@pytest.mark.slow
def test_the_run_trains_as_one_without_the_harness(scored, tmp_path):
    """The harness seeds Python's, NumPy's and torch's generators: the run's own streams are put back."""
    plain = train(tmp_path / "plain", "+preset=smoke", "checkpoint.save_final_model=false", small=False)
    assert [(r["step"], r["loss"]) for r in read_metrics(scored) if "loss" in r] == \
        [(r["step"], r["loss"]) for r in read_metrics(plain) if "loss" in r]


@pytest.mark.slow
def test_evaluate_prints_the_harness_table_of_a_checkpoint(scored, capsys):
    """A checkpoint of a one-process run scores as the final model it became (both are step 20)."""
    from trainloop.tools.evaluate import main

    main([str(scored / "checkpoints" / "step_0000020"), "--tasks", "pydoc_order", "--limit", str(LIMIT)])
    table = capsys.readouterr().out
    acc = harness_lines(scored)[-1]["pydoc_order/acc"]
    row = next(line for line in table.splitlines() if line.startswith("|pydoc_order"))
    assert abs(float(row.split("|")[7]) - acc) <= 5e-5, table  # the harness's table: 4 significant digits


@pytest.mark.slow
def test_the_report_draws_a_panel_per_task(scored, tmp_path):
    from trainloop.tools.report import main

    drawn = panels(main([str(scored), "-o", str(tmp_path / "report.png")]))
    order = drawn["pydoc_order (lm-evaluation-harness)"]
    lines = {line.get_label().split()[-1]: line for line in order.get_lines()}
    assert set(lines) == {"acc", "acc_norm"} and "pydoc_words (lm-evaluation-harness)" in drawn
    logged = harness_lines(scored)
    assert list(lines["acc"].get_xdata()) == [10, 20]
    assert list(lines["acc"].get_ydata()) == [line["pydoc_order/acc"] for line in logged]


@pytest.mark.slow
def test_a_task_the_harness_cannot_find_stops_before_training():
    """Not in the shipped folder: the harness's registry is indexed (15 s) before the task is called unknown."""
    from trainloop.errors import ConfigError
    from trainloop.observe.harness import Harness

    cfg = compose("+preset=smoke", "eval.harness.tasks=[pydoc_order,no_such_task]")
    with pytest.raises(ConfigError, match=r"^eval.harness.tasks: no task no_such_task in the shipped tasks .*"
                                          r"pydoc_order.*`lm_eval ls tasks --include_path DIR`"):
        Harness.for_config(cfg, tokenizer=None)


def test_a_local_task_that_cannot_load_is_named_without_a_hint_about_the_hub(tmp_path):
    """A task of include_path whose data file is missing (issue 58, item 10): the hint is to fix the
    task, not the registry's "downloads its data from the hub"."""
    import shutil

    from trainloop.errors import ConfigError
    from trainloop.observe.harness import Harness

    shutil.copy(SHIPPED / "local_jsonl.py", tmp_path)
    yaml = (SHIPPED / "pydoc_order.yaml").read_text()
    (tmp_path / "broken.yaml").write_text(yaml.replace("task: pydoc_order", "task: broken_order")
                                          .replace("file: pydoc_order.jsonl", "file: missing.jsonl"))
    cfg = compose("+preset=smoke", "eval.harness.tasks=[broken_order]", f"eval.harness.include_path={tmp_path}")
    with pytest.raises(ConfigError, match=r"^eval.harness.tasks: the harness could not load broken_order: "
                                          r"FileNotFoundError: .*missing.jsonl.*; fix the task's YAML file or its data$"):
        Harness.for_config(cfg, tokenizer=None)


def test_the_harness_not_installed_stops_the_run_in_one_line(tmp_path):
    """Run as a user without the extra: lm_eval not importable (sys.modules' None is how Python says so)."""
    code = ("import sys; sys.modules['lm_eval'] = None; sys.argv[1:] = ['+preset=smoke', "
            "'eval.harness.tasks=[pydoc_order]', 'hydra.run.dir=run']; from trainloop.__main__ import main; main()")
    done = launch(["python", "-c", code], cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(errors) == 2 and errors[0] == "trainloop: error: invalid config:", errors
    assert errors[1].strip() == ("eval.harness.tasks needs lm-evaluation-harness, which is not installed: pip "
                                 "install 'trainloop[eval]' (in a checkout: .venv/bin/pip install -c constraints.txt "
                                 "-e '.[eval]')")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, message", [
    (["eval.harness.tasks=[pydoc_order]", "eval.harness.include_path=/no/such/dir"],
     r"eval.harness.include_path=/no/such/dir is not a folder"),
    (["eval.harness.tasks=[pydoc_order]", "eval.harness.every=0"], r"eval.harness.every=0 must be greater than 0"),
    (["eval.harness.tasks=[pydoc_order]", "eval.harness.batch_size=0"], r"eval.harness.batch_size=0 must be"),
    (["eval.harness.tasks=[pydoc_order]", "eval.harness.num_fewshot=-1"], r"eval.harness.num_fewshot=-1 must be 0"),
    (["eval.harness.tasks=[pydoc_order]", "objective=reward", "data=preference", "data.path=x.jsonl"],
     r"objective=reward trains a model that ends in a scalar score"),
    (["eval.harness.tasks=[pydoc_order]", "parallel.pp_size=2"],
     r"parallel.pp_size=2 splits it: score final/ after training instead \(python -m trainloop.evaluate"),
])
def test_what_the_harness_cannot_score_is_refused_by_key(overrides, message):
    from trainloop.config.compose import ConfigError, validate

    with pytest.raises(ConfigError, match=message):
        validate(compose("+preset=smoke", *overrides))


def test_harness_keys_without_tasks_are_refused_naming_eval_harness_tasks():
    from trainloop.config.compose import ConfigError, check_command_line

    overrides = ["eval.harness.every=5"]
    with pytest.raises(ConfigError, match=r"eval.harness.every=5 has no effect unless eval.harness.tasks=\[...\]"):
        check_command_line(compose(*overrides), overrides)


def test_evaluate_refuses_what_holds_no_model(tmp_path, capsys):
    from trainloop.tools.evaluate import main

    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--tasks", "pydoc_order"])
    assert stop.value.code == 2
    assert f"error: {tmp_path} holds no model: give a run directory with a final/" in capsys.readouterr().err


def test_evaluate_names_a_missing_directory_before_it_reads_the_tasks(tmp_path, capsys):
    """The directory first (issue 58, item 1): a task nobody has would take the registry's index (a
    minute) to refuse, and was reported instead of the typo in the path."""
    from trainloop.tools.evaluate import main

    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "absent"), "--tasks", "no_such_task"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'absent'} does not exist: give a run directory, its " \
        "final/, or a checkpoint\n"


def test_scores_name_each_task_and_metric():
    from trainloop.observe.harness import scores

    results = {"results": {"pydoc_order": {"alias": "pydoc_order", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                           "sample_len": 60},
                           "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"}}}
    assert scores(results) == {"pydoc_order/acc": 0.5, "pydoc_order/acc_stderr": 0.1,
                               "gsm8k/exact_match,strict-match": 0.25}
