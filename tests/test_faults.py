"""Faults end in one message that says what happened: a full disk during a save, a truncated or
broken checkpoint (resume=auto falls back to the newest one that loads), unreadable data files,
rows without text, and a resume onto other data; and `kill -9` of a run leaves none of its processes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import alive, clean_env, compose, family, launch, read_metrics, train
from trainloop.checkpoint.integrity import COMPLETE, STATE_FILE, why_unloadable
from trainloop.config.compose import ConfigError

FINISHED = ["checkpoint.every_steps=1", "checkpoint.keep_last=2", "checkpoint.save_final_model=false"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """4 steps on the pydoc data, a checkpoint after each, step_0000003 and step_0000004 kept."""
    return train(tmp_path_factory.mktemp("faults") / "run", *FINISHED)


def copy_of(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def rot(path: Path) -> None:
    """Bit rot: 4 KiB in the middle of the file flipped in place; size and headers stay as they were."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    path.write_bytes(data)


# (file, damage): truncation is caught by sizes and formats, bit rot by the checksums alone
DAMAGES = [("model.safetensors", truncate), ("optimizer.bin", truncate), (STATE_FILE, truncate),
           ("model.safetensors", rot)]


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single `trainloop: error:` line of a run that failed on bad input, without a traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


# --- A full disk ------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB file system: one smoke checkpoint (1.8 MiB) fits, a second does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mount)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_message_and_the_previous_checkpoint_stays(small_disk):
    run = small_disk / "run"
    proc = launch(["python", "-m", "trainloop", "+preset=smoke", "trainer.max_steps=4", "checkpoint.every_steps=2",
                   "logging.progress_bar=false", f"hydra.run.dir={run}"], check=False)
    error = one_error_line(proc)
    previous = run / "checkpoints" / "step_0000002"
    assert "no space left on device for checkpoint" in error and "step_0000004" in error, error
    assert f"the previous checkpoint {previous} is intact" in error, error
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000002"]  # no .tmp_
    assert why_unloadable(previous) is None


# --- Broken checkpoints -------------------------------------------------------------------------

@pytest.mark.parametrize("broken, damage", DAMAGES)
def test_resume_auto_falls_back_to_the_newest_checkpoint_that_loads(finished_run, tmp_path, caplog, broken, damage):
    run = copy_of(finished_run, tmp_path)
    damage(run / "checkpoints" / "step_0000004" / broken)
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train(run, *FINISHED, "trainer.max_steps=5")
    warned = [r.getMessage() for r in caplog.records if "does not load" in r.getMessage()]
    assert len(warned) == 1 and f"step_0000004/{broken}" in warned[0], warned
    assert f"resumed from {run / 'checkpoints' / 'step_0000003'} at step 3" in caplog.text
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2, 3, 4, 4, 5]
    root = run / "checkpoints"  # the broken one is kept aside, never counted as a checkpoint again
    assert sorted(p.name for p in root.iterdir()) == ["broken_step_0000004", "latest", "step_0000004", "step_0000005"]


@pytest.mark.parametrize("broken, damage", DAMAGES)
def test_an_explicit_checkpoint_that_does_not_load_is_refused_naming_the_file(finished_run, tmp_path, broken, damage):
    run = copy_of(finished_run, tmp_path)
    damage(run / "checkpoints" / "step_0000004" / broken)
    with pytest.raises(ConfigError, match=re.escape(f"step_0000004/{broken}")) as refused:
        train(tmp_path / "elsewhere", f"checkpoint.resume={run / 'checkpoints' / 'step_0000004'}")
    assert f"The newest intact checkpoint beside it is {run / 'checkpoints' / 'step_0000003'}" in str(refused.value)


def test_a_broken_checkpoint_is_one_message_from_the_command_line(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    truncate(run / "checkpoints" / "step_0000004" / "model.safetensors")
    proc = launch(["python", "-m", "trainloop", "+preset=smoke", f"hydra.run.dir={tmp_path / 'elsewhere'}",
                   f"checkpoint.resume={run / 'checkpoints' / 'step_0000004'}"], check=False)
    assert "step_0000004/model.safetensors is 304776 bytes, but 609552 were saved" in one_error_line(proc)


def test_checkpoints_without_a_file_list_are_checked_by_their_formats(finished_run, tmp_path):
    """Checkpoints saved before trainloop recorded file sizes and checksums: headers and zip
    directories. They still resume (a warning says so): damage in place goes unseen in them."""
    ckpt = copy_of(finished_run, tmp_path) / "checkpoints" / "step_0000004"
    state = json.loads((ckpt / STATE_FILE).read_text())
    del state["files"], state["crc32"]
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    assert why_unloadable(ckpt) is None
    intact = (ckpt / "model.safetensors").read_bytes()
    rot(ckpt / "model.safetensors")
    assert why_unloadable(ckpt) is None
    (ckpt / "model.safetensors").write_bytes(intact)
    for name, problem in [("optimizer.bin", "is truncated or corrupt"),
                          ("model.safetensors", "is 304776 bytes, but its header describes 609552")]:
        intact = (ckpt / name).read_bytes()
        truncate(ckpt / name)
        assert f"{ckpt / name} {problem}" in why_unloadable(ckpt)
        (ckpt / name).write_bytes(intact)
    (ckpt / "model.safetensors").write_bytes(b"\x01")
    assert "header is cut off" in why_unloadable(ckpt)


def test_every_file_has_a_checksum_and_verify_resume_names_a_damaged_one(finished_run, tmp_path, capsys):
    from trainloop.tools.verify_resume import main

    run = copy_of(finished_run, tmp_path)
    state = json.loads((run / "checkpoints" / "step_0000004" / STATE_FILE).read_text())
    assert set(state["crc32"]) == set(state["files"]) >= {"model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                          "config.yaml"}
    assert main(["--check", str(run)]) == 0
    rot(run / "checkpoints" / "step_0000004" / "model.safetensors")
    assert main(["--check", str(run)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == f"checkpoint {run / 'checkpoints' / 'step_0000003'}: intact"
    assert out[-1].startswith(f"checkpoint {run / 'checkpoints' / 'step_0000004'}: DAMAGED: "
                              f"{run / 'checkpoints' / 'step_0000004' / 'model.safetensors'} does not match the "
                              "checksum saved with it"), out


def test_resume_auto_refuses_when_no_checkpoint_loads(finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    for step in ("step_0000003", "step_0000004"):
        truncate(run / "checkpoints" / step / "optimizer.bin")
    with pytest.raises(ConfigError, match="no checkpoint in .* loads: .*step_0000004/optimizer.bin"):
        train(run, *FINISHED, "trainer.max_steps=5")
    assert (run / "checkpoints" / "step_0000004" / COMPLETE).is_file()  # nothing moved or removed


# --- Resuming onto other data -------------------------------------------------------------------

def test_resuming_with_other_data_is_refused_naming_it(finished_run, tiny_jsonl):
    with pytest.raises(ConfigError, match=r"changed: data\.name: 'pydoc' -> 'files'; data\.path: None -> "):
        train(finished_run, "data=files", f"data.path={tiny_jsonl}", "data.text_field=content")


def test_resuming_after_the_data_files_changed_is_refused(tmp_path, tiny_jsonl):
    files = ["data=files", f"data.path={tiny_jsonl}", "data.text_field=content", "trainer.max_steps=2", *FINISHED]
    run = train(tmp_path / "run", *files)
    lines = tiny_jsonl.read_text().splitlines()
    tiny_jsonl.write_text("\n".join(lines[1:]) + "\n")  # one document less
    with pytest.raises(ConfigError, match=r"changed: data content: '\d+ train \+ \d+ valid blocks"):
        train(run, *files[:-len(FINISHED) - 1], "trainer.max_steps=3", *FINISHED)


def test_a_checkpoint_from_before_the_data_checks_still_resumes(finished_run, tmp_path, caplog):
    run = copy_of(finished_run, tmp_path)
    state_file = run / "checkpoints" / "step_0000004" / STATE_FILE
    state = json.loads(state_file.read_text())
    state["fingerprint"] = {k: v for k, v in state["fingerprint"].items()
                            if not k.startswith("data.") or k in ("data.batch_size", "data.seq_len")}
    state["fingerprint"].pop("data content")
    state["fingerprint"].pop("tokenizer vocabulary")
    state_file.write_text(json.dumps(state))
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train(run, *FINISHED, "trainer.max_steps=5")
    assert "resumed from" in caplog.text and "at step 4" in caplog.text
    assert re.search(r"saved before trainloop recorded data\.name, .*data\.path", caplog.text), caplog.text
    assert "saved before trainloop recorded tokenizer vocabulary, data content" in caplog.text


# --- Bad data files -----------------------------------------------------------------------------

GARBAGE = bytes(range(256)) * 40  # not UTF-8 (0x80 cannot start a character), not parquet


@pytest.mark.parametrize("name, content, says", [
    ("empty.jsonl", b"", "is empty"),
    ("garbage.jsonl", GARBAGE, "cannot be read as json (UnicodeDecodeError"),
    ("garbage.txt", GARBAGE, "cannot be read as text (UnicodeDecodeError"),
    ("garbage.parquet", GARBAGE, "cannot be read as parquet (ArrowInvalid"),
])
def test_an_unreadable_data_file_is_refused_naming_the_key_and_the_file(tmp_path, name, content, says):
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(content)
    if name.endswith(".jsonl"):  # a readable file beside it: the message names the bad one
        (data / "good.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"data.path='{data}': {data / name} {says}")):
        train(tmp_path / "run", "data=files", f"data.path={data}")


def test_garbage_data_is_one_message_from_the_command_line(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(GARBAGE)
    proc = launch(["python", "-m", "trainloop", "+preset=smoke", "data=files", f"data.path={garbage}",
                   f"hydra.run.dir={tmp_path / 'run'}"], check=False)
    assert f"{garbage} cannot be read as parquet" in one_error_line(proc)


def rows_file(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_rows_without_the_text_field_are_skipped_and_counted(tmp_path, caplog):
    from pydoc_data.topics import topics

    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    texts = [topics[k] for k in sorted(topics)[:30]]
    mixed = rows_file(tmp_path, [row for t in texts for row in ({"content": t}, {"other": "no content"})])
    cfg = compose("data=files", f"data.path={mixed}", "data.text_field=content", "data.seq_len=64",
                  "data.packing=stream").data  # streamed: every token lands in a block, countable below
    with caplog.at_level(logging.INFO, logger="trainloop"):
        train_set, valid_set = build_datasets(cfg, byte_level_tokenizer(), seed=0)
    assert "skipped 30 of 60 rows with no text in data.text_field='content'" in caplog.text
    tokens = sum(len(t.encode()) + 1 for t in texts)  # byte tokens + one EOS per document, none for the rest
    assert len(train_set) + len(valid_set) == tokens // 64


def test_data_where_no_row_has_text_is_refused(tmp_path):
    from trainloop.data.loaders import build_datasets, byte_level_tokenizer

    empty = rows_file(tmp_path, [{"content": None, "other": "x"}, {"content": "", "other": "y"}])
    cfg = compose("data=files", f"data.path={empty}", "data.text_field=content").data
    with pytest.raises(ConfigError, match="none of the 2 rows has text in data.text_field='content'"):
        build_datasets(cfg, byte_level_tokenizer(), seed=0)


# --- kill -9 leaves no process behind ---------------------------------------------------------

def processes_marked(marker: str) -> list[int]:
    """Processes whose environment holds `marker`: everything a run started, re-parented or not."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes().split(b"\0") and alive(int(environ.parent.name)):
                found.append(int(environ.parent.name))
        except OSError:  # it exited meanwhile, or is not ours to read
            pass
    return found


def test_kill_9_of_a_run_with_loader_workers_leaves_no_process(tmp_path):
    """Issue 23: SIGKILL a data=prepared run with 2 forkserver workers mid-training; within 10 s
    the workers, the forkserver and the resource tracker are gone too (they used to wait on one
    another forever: trainloop.lifetime)."""
    from trainloop.config.compose import compose_config
    from trainloop.data.shards import prepare

    prepare(compose_config(["+preset=smoke"]), str(tmp_path / "shards"), 10, progress=False)
    tag = uuid.uuid4().hex
    marker = f"TRAINLOOP_TEST_RUN={tag}"
    run_dir, output = tmp_path / "run", tmp_path / "output.txt"
    with open(output, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainloop", "+preset=smoke", "data=prepared", f"data.path={tmp_path / 'shards'}",
             "data.num_workers=2", "data.multiprocessing_context=forkserver", "trainer.max_steps=100000",
             "trainer.eval_every=100000", "trainer.log_every=1", "logging.progress_bar=false",
             f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, env=clean_env(TRAINLOOP_TEST_RUN=tag), stdout=out, stderr=subprocess.STDOUT)
    started, last_ended = [proc.pid], None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or '"loss"' not in (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None, f"it ended (exit {proc.returncode}):\n{output.read_text()[-4000:]}"
            assert time.monotonic() < deadline, output.read_text()[-4000:]
            time.sleep(0.1)
        started = family(proc.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in started]
        assert sum(b"forkserver import main" in c for c in commands) == 3, commands  # the server, 2 workers
        assert sum(b"resource_tracker import main" in c for c in commands) == 1, commands
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while time.monotonic() < killed + 10 and (
                any(alive(pid) for pid in started) or processes_marked(marker)):
            time.sleep(0.1)
        last_ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:  # it failed before the kill
            started = family(proc.pid)
            proc.kill()
            proc.wait()
        left = sorted({pid for pid in started if alive(pid)} | set(processes_marked(marker)))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, (f"10 s after kill -9 of the run (pid {proc.pid}), these of its processes still ran: "
                      f"{left}\n{output.read_text()[-3000:]}")
    print(f"the last of its {len(started)} processes ended {last_ended:.1f} s after the kill")


MAP_FOREVER = """
import sys, time, datasets
from trainloop.lifetime import register_forked_children
register_forked_children()  # as python -m trainloop and trainloop.prepare do
datasets.Dataset.from_dict({"x": list(range(1000))}).map(
    lambda batch: time.sleep(0.2) or batch, batched=True, batch_size=10, num_proc=2)
"""


def test_kill_9_during_a_datasets_map_with_num_proc_leaves_no_process(tmp_path):
    """datasets.map(num_proc=2) forks a pool, then a Manager that inherits the pool's task pipe:
    killed mid-map, the Manager served forever and the pool waited on it. Forked children now end
    with their parent (trainloop.lifetime.register_forked_children)."""
    proc = subprocess.Popen([sys.executable, "-c", MAP_FOREVER], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(started := family(proc.pid)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the pool's 2 workers and the Manager
    time.sleep(1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    while any(alive(pid) for pid in started) and time.monotonic() < killed + 10:
        time.sleep(0.1)
    left = [pid for pid in started if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert len(started) == 4 and not left, f"of {started}, {left} still ran 10 s after kill -9"
