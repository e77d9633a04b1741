"""The DeepSpeed JSON comes from the one config; contradictions and bad input stop before training.

Fast: these compose the real config and call the real builders, no training. The launches
that train on 2 processes are in test_distributed.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from helpers import REPO, clean_env, compose, launch, train
from trainloop.config.compose import ConfigError, validate
from trainloop.parallel.deepspeed_config import deepspeed_config
from trainloop.parallel.accelerator import build_accelerator, check_launcher_env
from trainloop.data.loaders import check_batch_fits

PRESETS = sorted(p.stem for p in (REPO / "conf" / "preset").glob("*.yaml"))


@pytest.mark.parametrize("preset, stage, optimizer_device, param_device", [
    ("ddp", 0, None, None),
    ("zero2", 2, "none", "none"),
    ("zero3", 3, "none", "none"),
    ("zero3_offload", 3, "cpu", "cpu"),
    ("zero3_nvme", 3, "nvme", "nvme"),
])
def test_presets_set_the_zero_stage_and_offload(preset, stage, optimizer_device, param_device, tmp_path):
    assert preset in PRESETS
    overrides = [f"+preset={preset}"] + (["deepspeed.nvme_path=" + str(tmp_path)] if param_device == "nvme" else [])
    cfg = compose(*overrides)
    validate(cfg)
    assert cfg.deepspeed.stage == stage
    if stage == 0:
        return
    zero = deepspeed_config(cfg, world_size=2)["zero_optimization"]
    assert zero["stage"] == stage
    assert zero["offload_optimizer"]["device"] == optimizer_device
    assert zero["offload_param"]["device"] == param_device
    if param_device == "nvme":
        assert zero["offload_param"]["nvme_path"] == str(tmp_path.resolve())


def test_presets_stack_on_others():
    cfg = compose("+preset=[smoke,zero3_offload]")
    assert (cfg.model.num_layers, cfg.deepspeed.stage, cfg.deepspeed.offload_param) == (2, 3, "cpu")


def test_generated_json_takes_batch_accumulation_clipping_precision_from_their_groups():
    cfg = compose("+preset=zero3", "data.batch_size=3", "trainer.gradient_accumulation_steps=5",
                  "trainer.max_grad_norm=0.5", "precision=bf16", "deepspeed.reduce_bucket_size=1000")
    config = deepspeed_config(cfg, world_size=4)
    assert config["train_micro_batch_size_per_gpu"] == 3
    assert config["gradient_accumulation_steps"] == 5
    assert config["train_batch_size"] == 3 * 5 * 4
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    # trainloop builds the optimizer; accelerate must not swap it for one of its own
    assert config["zero_force_ds_cpu_optimizer"] is False


def write_json(path, config: dict):
    path.write_text(json.dumps(config))
    return str(path)


def test_config_file_adds_keys_and_fills_auto(tmp_path):
    file = write_json(tmp_path / "ds.json", {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 12345, "sub_group_size": 1000,
                              "offload_param": {"pin_memory": True, "buffer_count": 6}},
        "aio": {"block_size": 262144},
    })
    cfg = compose("+preset=zero3_offload", "data.batch_size=4", "trainer.gradient_accumulation_steps=2",
                  f"deepspeed.config_file={file}")
    config = deepspeed_config(cfg, world_size=2)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["train_batch_size"] == 16
    assert config["aio"] == {"block_size": 262144}
    assert config["zero_optimization"]["sub_group_size"] == 1000
    # deepspeed.reduce_bucket_size is at trainloop's default: the file's tuning is taken
    assert config["zero_optimization"]["reduce_bucket_size"] == 12345
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True, "buffer_count": 6}
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize("in_file, overrides, expected", [
    ({"zero_optimization": {"stage": 2}}, ["+preset=zero3"],
     "zero_optimization.stage=2 in the file, but deepspeed.stage gives 3"),
    ({"gradient_accumulation_steps": 4}, ["+preset=zero2"],
     "gradient_accumulation_steps=4 in the file, but trainer.gradient_accumulation_steps gives 1"),
    ({"bf16": {"enabled": True}}, ["+preset=zero2", "precision=fp32"],
     "bf16.enabled=True in the file, but precision gives False"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, ["+preset=zero3"],
     "zero_optimization.offload_param.device='cpu' in the file, but deepspeed.offload_param gives 'none'"),
    ({"zero_optimization": {"overlap_comm": True}}, ["+preset=zero2", "deepspeed.overlap_comm=false"],
     "zero_optimization.overlap_comm=True in the file, but deepspeed.overlap_comm=False"),
    ({"optimizer": {"type": "Adam"}}, ["+preset=zero2"], "trainloop builds the optimizer from optimizer="),
    ({"train_batch_size": 16}, ["+preset=zero2", "data.batch_size=4"],
     "16 is not divisible by data.batch_size=4 x 3 processes"),
    ({"zero_optimization": {"stage": 3}}, [],
     "zero_optimization.stage=3 in the file, but deepspeed.stage gives 0"),
])
def test_config_file_contradictions_name_both_values(tmp_path, in_file, overrides, expected):
    file = write_json(tmp_path / "ds.json", in_file)
    cfg = compose(*overrides, f"deepspeed.config_file={file}")
    with pytest.raises(ConfigError) as err:
        deepspeed_config(cfg, world_size=3)
    assert expected in str(err.value)
    assert file in str(err.value)


def test_config_file_batch_that_fits_another_accumulation_says_which(tmp_path):
    file = write_json(tmp_path / "ds.json", {"train_batch_size": 32})
    cfg = compose("+preset=zero2", "data.batch_size=4", f"deepspeed.config_file={file}")
    with pytest.raises(ConfigError, match=r"with 2 processes, trainer.gradient_accumulation_steps=4 gives it"):
        deepspeed_config(cfg, world_size=2)


def test_a_run_stops_on_a_contradicting_config_file_before_training(tmp_path):
    file = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="zero_optimization.stage=1 in the file, but deepspeed.stage gives 3"):
        train(tmp_path / "run", "+preset=[smoke,zero3]", f"deepspeed.config_file={file}", small=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("env, overrides, expected", [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, [], "ACCELERATE_USE_DEEPSPEED=true) but deepspeed.stage=0"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, ["+preset=zero3"],
     "--zero_stage 2 (ACCELERATE_DEEPSPEED_ZERO_STAGE=2) but the config has deepspeed.stage=3"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, ["+preset=zero3"],
     "--offload_optimizer_device cpu (ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=cpu) but the config "
     "has deepspeed.offload_optimizer=none"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"}, ["+preset=zero3_offload"],
     "deepspeed.offload_param=cpu"),
    ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, ["+preset=zero2", "trainer.gradient_accumulation_steps=2"],
     "--gradient_accumulation_steps 4 (ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4) but the config has "
     "trainer.gradient_accumulation_steps=2"),
    ({"ACCELERATE_GRADIENT_CLIPPING": "2.0"}, [], "but the config has trainer.max_grad_norm=1.0"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, [],
     "--mixed_precision bf16 (ACCELERATE_MIXED_PRECISION) but the config has precision=fp32"),
    ({"ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}, ["+preset=zero3"],
     "--zero3_init_flag true (ACCELERATE_DEEPSPEED_ZERO3_INIT=true) but the config has deepspeed.zero3_init=False"),
])
def test_launcher_flags_that_disagree_stop(env, overrides, expected):
    cfg = compose(*overrides)
    with pytest.raises(ConfigError) as err:
        check_launcher_env(cfg, env)
    assert expected in str(err.value)


def test_launcher_flags_that_agree_pass():
    cfg = compose("+preset=zero3_offload", "trainer.gradient_accumulation_steps=2", "precision=bf16")
    check_launcher_env(cfg, {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "none",
    })
    # `accelerate launch` exports "no" whenever --mixed_precision is not given: the group decides
    check_launcher_env(compose("precision=bf16"), {"ACCELERATE_MIXED_PRECISION": "no"})


def test_launcher_config_file_is_checked_like_deepspeed_config_file(tmp_path):
    file = write_json(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}})
    cfg = compose("+preset=zero3")
    check_launcher_env(cfg, {"ACCELERATE_DEEPSPEED_CONFIG_FILE": file})
    assert cfg.deepspeed.config_file == file
    with pytest.raises(ConfigError, match="zero_optimization.stage=2 in the file"):
        deepspeed_config(cfg, world_size=2)


@pytest.mark.slow
def test_accelerate_launch_with_contradicting_flags_stops(tmp_path):
    """The real launcher's variables: --use_deepspeed --zero_stage 2 against +preset=zero3."""
    proc = launch(["accelerate", "launch", "--use_deepspeed", "--zero_stage", "2", "--mixed_precision", "bf16",
                   "--num_processes", "1", "-m", "trainloop", "+preset=[smoke,zero3]",
                   f"hydra.run.dir={tmp_path / 'run'}"], check=False, env=clean_env(DS_ACCELERATOR="cpu"))
    assert proc.returncode != 0
    assert "the launcher and the config disagree" in proc.stderr, proc.stderr[-3000:]
    assert "--zero_stage 2 (ACCELERATE_DEEPSPEED_ZERO_STAGE=2) but the config has deepspeed.stage=3" in proc.stderr
    assert "--mixed_precision bf16 (ACCELERATE_MIXED_PRECISION) but the config has precision=fp32" in proc.stderr


@pytest.mark.parametrize("overrides, expected", [
    (["+preset=zero3", "optimizer=adamw8bit"], "optimizer=adamw8bit (bitsandbytes) cannot run under deepspeed stage 3"),
    (["+preset=zero3_nvme"], "deepspeed offload to nvme needs deepspeed.nvme_path=DIR"),
    (["deepspeed=zero2", "deepspeed.offload_optimizer=nvme"], "needs deepspeed.nvme_path"),
    (["deepspeed=zero2", "deepspeed.offload_param=cpu"], "deepspeed.offload_param=cpu needs deepspeed stage 3"),
])
def test_impossible_deepspeed_combinations_fail_validation(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(compose(*overrides))


def test_missing_deepspeed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # how Python reports a package that is not installed
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(ConfigError, match="deepspeed.stage=2 needs DeepSpeed, which cannot be imported.*"
                                          "pip install deepspeed, or set deepspeed=none"):
        build_accelerator(compose("+preset=zero2"))


def test_world_size_that_leaves_a_rank_without_a_batch_is_refused():
    cfg = compose("data.batch_size=4")
    check_batch_fits(cfg, dp_size=2, train_blocks=8)
    with pytest.raises(ConfigError, match=r"data.batch_size=4 x 3 processes needs 12 training blocks"):
        check_batch_fits(cfg, dp_size=3, train_blocks=8)


def test_nvme_without_libaio_names_what_to_install(tmp_path, monkeypatch):
    """DeepSpeed's own libaio probe (compile and link io_submit) fails, as on a machine without libaio-dev."""
    monkeypatch.setenv("LDFLAGS", "-lno_such_library_for_trainloop_test")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = compose("+preset=[smoke,zero3_nvme]", f"deepspeed.nvme_path={tmp_path / 'swap'}")
    with pytest.raises(ConfigError) as err:
        build_accelerator(cfg)
    assert "libaio" in str(err.value) and "apt-get install libaio-dev" in str(err.value)


def test_deepspeeds_ops_compile_through_ccache_and_a_second_venv_reuses_them(tmp_path, monkeypatch):
    """compiler_cache (build_ops compiles inside it): torch's JIT build runs `c++`, here ccache. The same source
    compiled from a second venv's folder (another path, as a clean clone's) is a cache hit: the paths under the
    venv (sys.prefix) are hashed relative to the build folder. The environment comes back after."""
    import os
    import shutil
    import subprocess

    from trainloop.parallel.deepspeed_config import compiler_cache

    if shutil.which("ccache") is None:
        pytest.skip("ccache is not installed here (scripts/setup.sh installs it where it runs as root with apt)")
    for key in ("CXX", "CCACHE_BASEDIR", "CCACHE_NOHASHDIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "cache"))
    for venv in (tmp_path / "a" / ".venv", tmp_path / "b" / ".venv"):
        (venv / "build").mkdir(parents=True)
        (venv / "op.cpp").write_text("int twice(int x) { return 2 * x; }\n")
        monkeypatch.setattr(sys, "prefix", str(venv))  # a run's venv
        before = dict(os.environ)
        with compiler_cache():
            assert Path(shutil.which("c++")).resolve() == Path(shutil.which("ccache")).resolve()
            subprocess.run(["c++", "-g", "-O2", "-c", str(venv / "op.cpp"), "-o", "op.o"], cwd=venv / "build",
                           check=True)
        assert dict(os.environ) == before
        assert (venv / "build" / "op.o").stat().st_size > 0
    stats = dict(line.split("\t") for line in subprocess.run(["ccache", "--print-stats"], capture_output=True,
                                                              text=True, check=True).stdout.splitlines())
    assert (int(stats["direct_cache_miss"]), int(stats["direct_cache_hit"])) == (1, 1)
