"""logging.trackers: every metrics.jsonl line reaches TensorBoard, MLflow and W&B, read back with
each library's own reader, offline, from the run directory (issue 17, checks 1 and 2)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import pytest

from helpers import MLFLOW, SMALL, clean_env, compose, launch, read_metrics, reset_accelerate, train, wait_for_step, warm
from trainloop.build import settle_learning_rate
from trainloop.observe.trackers import TRACKERS, Trackers


def by_step(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def mlflow_run(store: Path, monkeypatch):
    """MLflow's client on the file store in `store`, and the one run of experiment trainloop there."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when allowed
    client = MlflowClient(tracking_uri=store.as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("trainloop").experiment_id])
    return client, run


def test_the_default_run_writes_tensorboard_scalars_equal_to_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = train(tmp_path / "run", "eval.prompts=['def ']", "eval.max_new_tokens=8")
    records = read_metrics(run_dir)
    for key in ("loss", "eval_loss", "lr"):
        expected = by_step(records, key)
        assert len(expected) >= 2
        # TensorBoard keeps float32
        assert tensorboard_scalars(run_dir / "tensorboard", key) == pytest.approx(expected, rel=1e-6), key
    samples = {r["step"]: r["samples"][0]["text"] for r in records if r.get("event") == "samples"}
    assert len(samples) >= 2  # at every evaluation
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/0/text_summary")}
    assert texts.keys() == samples.keys() and all(samples[step] in texts[step] for step in samples)
    assert not (run_dir / "mlruns").exists() and not (run_dir / "wandb").exists()
    # the composed config as hyperparameters, in the run's own folder: no sub-run beside it
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(start).session_start_info.hparams
    trained = compose(*SMALL)
    settle_learning_rate(trained)  # the rate the run trained at: optimizer=adamw's for a model from scratch
    assert hparams["optimizer.lr"].number_value == pytest.approx(trained.optimizer.lr) == 1e-3
    assert hparams["model.name"].string_value == "tiny"
    assert not [p for p in (run_dir / "tensorboard").iterdir() if p.is_dir()]


def test_mlflow_logs_params_and_metrics_to_a_file_store_in_the_run_dir(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    run_dir = train(tmp_path / "run", "logging.trackers=[mlflow]", "logging.telemetry_every=2")
    records = read_metrics(run_dir)
    client, run = mlflow_run(run_dir / "mlruns", monkeypatch)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    cfg = compose(*SMALL, "logging.trackers=[mlflow]", "logging.telemetry_every=2")
    settle_learning_rate(cfg)
    assert run.data.params["optimizer.lr"] == str(cfg.optimizer.lr) == "0.001"
    assert run.data.params["trainer.max_steps"] == "4"
    assert run.data.params["logging.trackers"] == '["mlflow"]'
    for key in ("loss", "eval_loss", "tokens_per_s"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == pytest.approx(by_step(records, key), rel=1e-12), key
    telemetry = [r for r in records if r.get("event") == "telemetry"]
    assert telemetry
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "telemetry/rss_bytes")}
    assert logged == {r["step"]: r["rss_bytes"] for r in telemetry}  # an event's values under EVENT/
    assert not (run_dir / "tensorboard").exists()


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (.wandb): W&B's protobuf Records in LevelDB's log format,
    as wandb-core writes them (W&B's own Python reader of this file is gone from wandb 0.31)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, pending = 32768, 7, [], b""  # 7: the file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_services() -> dict[int, list[str]]:
    """Running wandb-core services (W&B's service process), by the pid of the process they serve."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args[0].endswith("wandb-core") and "--pid" in args:
            found[int(args[args.index("--pid") + 1])] = args
    return found


def wandb_history(run_dir: Path) -> tuple[dict[int, dict], dict]:
    """The history rows (by step) and the config of the one offline W&B run under run_dir."""
    [offline] = (run_dir / "wandb").glob("offline-run-*")
    [run_file] = offline.glob("*.wandb")
    history, config = {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(row)
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return history, config


@pytest.mark.slow
def test_wandb_writes_an_offline_run_holding_the_logged_values(tmp_path):
    run_dir = tmp_path / "run"
    env = clean_env()
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        env.pop(name, None)
    done = launch(["python", "-m", "trainloop", *SMALL, "logging.trackers=[wandb]", f"hydra.run.dir={run_dir}"],
                  cwd=tmp_path, env=env)
    history, config = wandb_history(run_dir)
    records = read_metrics(run_dir)
    for key in ("loss", "eval_loss", "lr"):
        logged = {step: row[key] for step, row in history.items() if key in row}
        assert logged == by_step(records, key), key
    assert config["trainer.max_steps"] == 4 and config["logging.trackers"] == '["wandb"]'
    orphans = [args for pid, args in wandb_services().items() if not Path(f"/proc/{pid}").exists()]
    assert not orphans, f"W&B services outlived the run they served: {orphans}"
    assert "wandb sync" in done.stdout + done.stderr  # offline: W&B says how to upload it later


def test_an_unknown_or_missing_tracker_is_refused_before_training(tmp_path):
    missing = next((name for name, t in TRACKERS.items() if importlib.util.find_spec(t.package) is None), None)
    if missing is None:
        pytest.skip("every tracker accelerate supports is installed here")
    run_dir = tmp_path / "run"
    done = warm(1, ["+preset=smoke", f"logging.trackers=[tensorbored,{missing}]",
                   f"hydra.run.dir={run_dir}"], cwd=tmp_path, check=False, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "'tensorbored' is not a tracker; choose from: tensorboard, mlflow, wandb" in done.stderr
    assert f"logging.trackers: {missing} is not installed: {TRACKERS[missing].install}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_the_table_holds_every_tracker_accelerate_supports():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    assert set(TRACKERS) == set(LOGGER_TYPE_TO_CLASS)
    assert TRACKERS["mlflow"].install == "pip install 'trainloop[mlflow]'"


SAMPLES = [{"prompt": "def ", "text": "def foo(x):\n    return x"}, {"prompt": "class ", "text": "class A: pass"}]


def write_through_metrics(run_dir: Path, tracker: str):
    """Start `tracker` on a real Accelerator and write records through Metrics, as a run does."""
    from accelerate import Accelerator

    from trainloop.observe.metrics import Metrics

    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    trackers = Trackers.start(accelerator, compose(*SMALL, f"logging.trackers=[{tracker}]"), run_dir)
    metrics = Metrics(run_dir, True, 10, 0, False, 1, trackers=trackers)
    metrics.write({"step": 2, "loss": 1.5, "tokens_per_source": {"a": 10, "/data/b~1.jsonl": 20}, "router_load": [0.25, 0.75],
                   "grad_norm": None})
    metrics.write({"step": 3, "event": "samples", "samples": SAMPLES})
    metrics.close()
    accelerator.end_training()


def test_samples_reach_tensorboard_as_text_and_nested_values_as_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_through_metrics(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for i, sample in enumerate(SAMPLES):
        [text] = events.Tensors(f"samples/{i}/text_summary")
        assert text.step == 3 and sample["text"] in text.tensor_proto.string_val[0].decode()
    assert tensorboard_scalars(tmp_path / "tensorboard", "tokens_per_source//data/b~1.jsonl") == {2: 20}
    assert tensorboard_scalars(tmp_path / "tensorboard", "router_load/1") == {2: 0.75}
    assert "grad_norm" not in events.Tags()["scalars"]


def test_samples_reach_mlflow_as_an_artifact_per_step(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    write_through_metrics(tmp_path, "mlflow")
    client, run = mlflow_run(tmp_path / "mlruns", monkeypatch)
    text = Path(client.download_artifacts(run.info.run_id, "samples/step_0000003.txt", str(tmp_path))).read_text()
    assert all(sample["text"] in text for sample in SAMPLES)
    assert run.data.metrics["tokens_per_source/a"] == 10
    assert run.data.metrics["tokens_per_source/data/b_1.jsonl"] == 20  # a source's path, as MLflow takes names


def test_samples_reach_wandb_as_a_table_and_its_service_ends(tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    try:
        write_through_metrics(tmp_path, "wandb")
    finally:
        wandb.teardown()  # the service a run in this (test) process started; a run's own process ends it at exit
    assert os.getpid() not in wandb_services()
    history, _ = wandb_history(tmp_path)
    assert history[2]["loss"] == 1.5 and history[2]["tokens_per_source/a"] == 10
    assert history[3]["samples/_type"] == "table-file" and history[3]["samples/nrows"] == len(SAMPLES)
    [table] = (tmp_path / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json")
    assert json.loads(table.read_text())["data"] == [[s["prompt"], s["text"]] for s in SAMPLES]


def test_a_failed_run_ends_its_mlflow_run_as_failed_with_every_line_logged(tmp_path, monkeypatch):
    from trainloop.errors import NonFiniteError

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError):  # lr=1e6: the loss goes non-finite within a few steps
        train(run_dir, "optimizer.lr=1e6", "trainer.on_nonfinite=stop", "trainer.max_steps=30",
              "logging.trackers=[mlflow,tensorboard]")
    client, run = mlflow_run(run_dir / "mlruns", monkeypatch)
    assert run.info.status == "FAILED"
    expected = by_step(read_metrics(run_dir), "loss")
    assert expected
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == expected
    assert tensorboard_scalars(run_dir / "tensorboard", "loss") == pytest.approx(expected, rel=1e-6)


def test_no_trackers_start_nothing(tmp_path):
    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    assert Trackers.start(accelerator, compose(*SMALL, "logging.trackers=[]"), tmp_path) is None
    assert accelerator.trackers == [] and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_preempted_run_leaves_every_logged_line_in_its_trackers(tmp_path, monkeypatch):
    import signal
    import subprocess


    run_dir = tmp_path / "run"
    env = clean_env(PYTHONPATH=str(MLFLOW))
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([sys.executable, "-m", "trainloop", "+preset=smoke", "trainer.max_steps=500",
                             "trainer.log_every=1", "logging.progress_bar=false",
                             "logging.trackers=[tensorboard,mlflow]", f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(run_dir, 2, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr[-3000:]
    expected = by_step(read_metrics(run_dir), "loss")
    assert len(expected) >= 2 and max(expected) < 500
    assert tensorboard_scalars(run_dir / "tensorboard", "loss") == pytest.approx(expected, rel=1e-6)
    client, run = mlflow_run(run_dir / "mlruns", monkeypatch)
    assert run.info.status == "FINISHED"  # ended by end_training, as the run ends after its checkpoint
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == expected
