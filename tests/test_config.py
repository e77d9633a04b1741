"""Every shipped config composes, validates and builds; bad input fails early and names the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import GROUPS, NEEDS, OPTIONS, clean_env, compose, launch, read_metrics, train, warm
from trainloop.config.compose import CONFIG_DIR, ConfigError, compose_config, misspelt_keys, validate

PRESETS = sorted(f.stem for f in (CONFIG_DIR / "preset").glob("*.yaml"))
PRESET_NEEDS = {"qlora": ["model.name_or_path=/some/model"],  # quantizes a pretrained model
                "ep": ["model.arch=mixtral"]}  # splits a mixture's experts
def test_groups_are_the_ones_documented():
    assert {"model", "data", "optimizer", "scheduler", "precision", "deepspeed", "compile"} <= set(GROUPS)
    assert "smoke" in PRESETS


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option):
    cfg = compose(f"{group}={option}", *NEEDS.get((group, option), []))
    assert OmegaConf.missing_keys(cfg) == set()
    if group == "deepspeed" and option != "none" and "nvme" in (cfg.deepspeed.offload_optimizer, cfg.deepspeed.offload_param):
        cfg.deepspeed.nvme_path = "/tmp"
    validate(cfg)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    text = (CONFIG_DIR / "preset" / f"{preset}.yaml").read_text()
    assert text.startswith("# @package _global_"), f"preset/{preset}.yaml must start with the global package line"
    cfg = compose(f"+preset={preset}", "deepspeed.nvme_path=/tmp", *PRESET_NEEDS.get(preset, []))
    validate(cfg)


def conflicting_presets() -> list[tuple[str, str]]:
    """Every pair of shipped presets that choose different options of one config group."""
    from itertools import combinations

    from trainloop.config.compose import preset_choices

    return [(a, b) for a, b in combinations(PRESETS, 2)
            if any(preset_choices(b).get(group, option) != option for group, option in preset_choices(a).items())]


def test_the_strategy_presets_conflict_pairwise():
    pairs = conflicting_presets()
    for strategy in ("ddp", "fsdp", "zero2"):
        assert (strategy, "zero3") in pairs and (strategy, "zero3_offload") in pairs, pairs
    assert ("ddp", "fsdp") in pairs and ("fsdp_offload", "zero2") in pairs, pairs
    assert ("smoke", "zero3") not in pairs and ("fsdp", "fsdp_offload") not in pairs, pairs


@pytest.mark.parametrize("a,b", conflicting_presets(), ids="-".join)
def test_conflicting_presets_are_refused_in_either_order_naming_both(a, b):
    from itertools import permutations

    from trainloop.config.compose import compose_config

    for order in [*permutations(["smoke", a, b])]:
        with pytest.raises(ConfigError, match=f"preset ({a}|{b}) sets .* preset ({a}|{b}) sets") as refused:
            compose_config([f"+preset=[{','.join(order)}]", "deepspeed.nvme_path=/tmp", "model.name_or_path=/m"])
        assert a in str(refused.value) and b in str(refused.value)


def test_presets_that_agree_stack_and_the_later_ones_keys_count():
    cfg = compose("+preset=[smoke,zero3_offload,zero3]")
    assert (cfg.deepspeed.stage, cfg.deepspeed.offload_param) == (3, "cpu")
    assert compose("+preset=[smoke,memory_saver]").data.batch_size == 2
    assert compose("+preset=[memory_saver,smoke]").data.batch_size == 4


def test_a_preset_conflict_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = launch(["python", "-m", "trainloop", "+preset=[smoke,zero3,fsdp]", f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("trainloop: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "preset zero3 sets deepspeed=zero3 and preset fsdp sets deepspeed=none" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_default_config_is_the_documented_one():
    cfg = compose()
    assert (cfg.model.name, cfg.data.name, cfg.optimizer.name, cfg.precision.name) == ("tiny", "pydoc", "adamw", "fp32")
    assert (cfg.deepspeed.stage, cfg.compile.backend, cfg.model.dropout) == (0, "none", 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_model_builds_with_requested_shape(arch):
    from trainloop.model.builder import build_model, build_model_config

    cfg = compose("+preset=smoke", f"model.arch={arch}")
    model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
    assert model.config.num_hidden_layers == cfg.model.num_layers
    assert model.config.hidden_size == cfg.model.hidden_size
    assert model.config.vocab_size % cfg.model.vocab_multiple == 0 and model.config.vocab_size >= 257
    assert model.config._attn_implementation == "sdpa"


def test_decay_groups_exclude_biases_and_norms():
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.optim.optimizers import parameter_groups

    cfg = compose("+preset=smoke", "model.arch=gpt2")
    model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay["weight_decay"] == 0.0
    assert any(n.endswith(".bias") for n in no_decay_names) and any("ln_" in n for n in no_decay_names)


@pytest.mark.slow
def test_trains_on_local_jsonl_with_local_tokenizer(tmp_path, tiny_jsonl, local_tokenizer):
    from transformers import AutoTokenizer

    run_dir = train(tmp_path / "run", "data=files", f"data.path={tiny_jsonl}", "data.text_field=content",
                    f"data.tokenizer={local_tokenizer}")
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]
    assert AutoTokenizer.from_pretrained(run_dir / "final").get_vocab() == \
        AutoTokenizer.from_pretrained(local_tokenizer).get_vocab()


@pytest.mark.slow
def test_fine_tunes_a_local_pretrained_model(tmp_path):
    first = train(tmp_path / "first")
    second = train(tmp_path / "second", "model=hf", f"model.name_or_path={first / 'final'}")
    losses = [r["loss"] for r in read_metrics(second) if "loss" in r]
    first_losses = [r["loss"] for r in read_metrics(first) if "loss" in r]
    assert losses[0] < first_losses[0], "the pretrained weights should start below a fresh model"


# --- bad input: caught before training, with the key named -------------------------------

def run_cli(*overrides: str, cwd: Path):
    return warm(1, [*overrides], cwd=cwd, check=False, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,key", [
    (["optimizer=nope"], "optimizer"),
    (["trainer.max_steps=abc"], "trainer.max_steps"),
    (["trainer.no_such_key=1"], "no_such_key"),
    (["trainer.max_step=3"], "no such key: trainer.max_step (did you mean trainer.max_steps?)"),  # Hydra's
    (["+trainer.max_step=3"], "no such key: trainer.max_step (did you mean trainer.max_steps?)"),  # added by +
    (["data.seq_len=4096", "+preset=smoke"], "data.seq_len"),
    (["data=files", "data.path=/no/such/file.jsonl"], "data.path"),
    (["model=hf"], "model.name_or_path"),
    (["precision.name=fp4"], "precision.name"),
])
def test_bad_input_exits_nonzero_naming_the_key(tmp_path, overrides, key):
    proc = run_cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr
    assert key in err, err[-3000:]
    assert "Traceback" not in err, "a known bad input gets one message, not a traceback"
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "nothing may train on bad input"


def test_a_key_added_with_plus_that_no_section_declares_is_refused_with_the_nearest():
    """Hydra's `+KEY=VALUE` adds a key to any section; nothing would read it, and the run would take the default."""
    for overrides, said in [
        (["+trainer.max_step=3"], "trainer.max_step (did you mean trainer.max_steps?)"),
        (["+trainer.lr=0.01"], "trainer.lr (did you mean optimizer.lr?)"),  # the same name in another section
        (["optimizer=sgd", "+optimizer.momentun=0.9"], "optimizer.momentun (did you mean optimizer.momentum?)"),
        (["+trainer.extra.depth=1"], "trainer.extra (python -m trainloop --cfg job lists every key)"),
        (["+optimzer=adamw"], "optimzer (did you mean optimizer?)"),  # a group's name
    ]:
        with pytest.raises(ConfigError) as refused:
            compose_config(overrides)
        assert str(refused.value) == f"no such key: {said}"
    assert misspelt_keys(["optimizer=sgd", "optimizer.momentun=0.9", "trainer.max_steps=3", "+preset=smoke",
                          "hydra.run.dir=x", "hydra/job_logging=stdout", "schedular=cosine"]) == [
        "optimizer.momentun (did you mean optimizer.momentum?)", "schedular (did you mean scheduler?)"]


def test_text_field_missing_from_data_is_named(tmp_path, tiny_jsonl):
    with pytest.raises(ConfigError, match=r"data.text_field='text'.*content"):
        train(tmp_path / "run", "data=files", f"data.path={tiny_jsonl}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_combinations_that_cannot_work_are_refused():
    for overrides, match in [
        (["deepspeed=zero3", "optimizer=adamw8bit"], "optimizer=adamw8bit"),
        (["deepspeed=zero3", "deepspeed.offload_optimizer=nvme"], "deepspeed.nvme_path"),
        (["deepspeed.offload_param=cpu"], "deepspeed.offload_param"),
        (["model.hidden_size=100", "model.num_heads=3"], "model.num_heads"),
        (["model.num_heads=4", "model.num_kv_heads=3"], "model.num_kv_heads=3 must divide model.num_heads=4"),
        (["model.arch=gpt2", "model.num_kv_heads=2"], "model.num_kv_heads=2 with model.arch=gpt2"),
        (["data.num_workers=0", "data.persistent_workers=true"], "data.num_workers"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(compose(*overrides))


def test_a_config_every_rank_refuses_is_said_once_under_a_launcher(tmp_path):
    """Issue 58, item 10: on 2 ranks a bad value is refused by both (exit 2), and said by the main rank alone,
    not once per rank above the launcher's report; the launcher's own summary, below its traceback, names it
    too: torch.distributed.elastic reads the ranks' error file as torchrun does."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    done = warm(2, ["+preset=smoke", "optimizer.lr=-1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                check=False, env=clean_env(TORCHELASTIC_ERROR_FILE=str(error_file)))
    assert done.returncode == 2
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("trainloop: error")]
    assert errors == ["trainloop: error: invalid config:"], done.stderr
    assert "optimizer.lr=-1.0 must be greater than 0, or null" in done.stderr
    summary = ProcessFailure(local_rank=0, pid=0, exitcode=2, error_file=str(error_file)).message
    assert summary.startswith("trainloop: error: invalid config:") and "optimizer.lr=-1.0" in summary
