"""The config a run gets: composed by Hydra from conf/ onto the schema, then checked.

Hydra merges conf/train.yaml and the chosen group options onto `TrainConfig` (trainloop/config/schema.py),
so an unknown key or a value of the wrong type fails while the config is composed. `validate()`
then checks what a type cannot say (choices, ranges, combinations) before anything is built: the
choices come from the tables of the modules that build each thing (optimizers, data formats,
strategies, objectives, trackers), and each of those modules states its own problems(cfg).
Nothing below this module imports it.
"""

from __future__ import annotations

import copy
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from hydra.core.config_store import ConfigStore

from trainloop.config.schema import OPTION_SCHEMAS, TrainConfig
from trainloop.config.sections import OptimizerConfig
from trainloop.errors import ConfigError  # noqa: F401 - raised here, and imported from here by users


def register_configs() -> None:
    """The schema conf/train.yaml extends, and the one each option of OPTION_SCHEMAS extends
    (conf/objective/dpo.yaml: `defaults: [/objective_dpo_schema@_here_]`), stored outside any group
    so that `--help` lists only the options a user chooses. Once per process: the store outlives compose."""
    store = ConfigStore.instance()
    if "trainloop_schema.yaml" in store.repo:
        return
    store.store(name="trainloop_schema", node=TrainConfig)
    for group, options in OPTION_SCHEMAS.items():
        for option, node in options.items():
            store.store(name=f"{group}_{option}_schema", node=node)


def compose_config(overrides: Sequence[str] = (), check: bool = True, return_hydra_config: bool = False):
    """The config `python -m trainloop OVERRIDES` runs with, composed the way Hydra composes it.

    With `check`, Hydra's own errors become a ConfigError and the config is checked as a run
    checks it (required keys, validate()); hydra.* overrides are left to Hydra's run.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [o for o in overrides if not (check and o.startswith("hydra."))]
    if check:
        check_presets(overrides)
    try:
        cfg = composed(overrides, return_hydra_config)
    except (HydraException, OmegaConfBaseException) as err:
        if not check:
            raise
        raise ConfigError(f"the overrides {' '.join(overrides)!r} do not compose: {err}") from None
    if check:
        check_complete(cfg)
        validate(cfg)
    return cfg


def composed(overrides: Sequence[str], return_hydra_config: bool):
    """What Hydra's compose returns for these overrides, as a copy of this process's own.

    Hydra takes 0.2-0.5 s to compose (23 files merged onto the schema), nearly all of it the defaults list: the
    group choices (`data=chat`, `+preset=smoke`). The other overrides it applies afterwards, one by one, onto the
    composed config (ConfigLoaderImpl._apply_overrides_to_config, after set_struct). So a process composes each
    set of group choices once, keyed by conf/'s files, and applies the rest to a copy with Hydra's own function:
    the same config, and the same errors, as a whole compose (tests/test_compose.py compares them). Tests compose
    thousands; a notebook's runs, a sweep's, the planner's presets several. The hydra node, hydra overrides
    (which can bring in files of their own) and sweeps compose whole every time.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    if return_hydra_config or any(o.is_hydra_override() or o.is_sweep_override() for o in parsed):
        return hydra_compose(overrides, return_hydra_config)
    # Hydra's own split (defaults_list.Overrides): applied later, a key that names no config group, or a dict value
    later = [not (CONFIG_DIR / o.key_or_group).is_dir() or isinstance(o.value(), dict) for o in parsed]
    choices = tuple(o for o, applied in zip(overrides, later) if not applied)
    key = (choices, conf_signature())
    if key not in COMPOSED:
        if len(COMPOSED) >= COMPOSED_KEPT:
            COMPOSED.pop(next(iter(COMPOSED)))
        COMPOSED[key] = hydra_compose(choices, return_hydra_config=False)
    cfg = copy.deepcopy(COMPOSED[key])
    ConfigLoaderImpl._apply_overrides_to_config([o for o, applied in zip(parsed, later) if applied], cfg)
    return cfg


def hydra_compose(overrides: Sequence[str], return_hydra_config: bool):
    """One compose by Hydra's compose API, of every override at once, from conf/ onto the schema."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=return_hydra_config)


COMPOSED: dict = {}  # (group choices, conf_signature()) -> the config Hydra composed from them
COMPOSED_KEPT = 256


def conf_signature() -> tuple:
    """conf/'s files as (path, size, modification time): a file edited since a config was composed composes anew."""
    return tuple((str(path), st.st_size, st.st_mtime_ns) for path in sorted(CONFIG_DIR.rglob("*.yaml"))
                 for st in [path.stat()])


def check_complete(cfg: Any) -> None:
    """Every required key has a value, and every key is one the schema declares: Hydra's `+KEY=VALUE` adds a
    key to any section, and nothing would read it."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError("required keys have no value: " + ", ".join(missing)
                          + " (set them on the command line, e.g. KEY=VALUE)")
    declared, unknown = keys_of(cfg)
    if unknown:
        raise ConfigError("no such key: " + "; ".join(no_such_key(key, declared) for key in unknown))


def keys_of(cfg: Any) -> tuple[list[str], list[str]]:
    """(the values' keys `cfg`'s schema declares, the keys it does not), dotted. A key's section is a dataclass of
    trainloop.config.sections (an option's, where the group has options); nothing below an undeclared key
    is read."""
    from dataclasses import is_dataclass

    from omegaconf import DictConfig, OmegaConf

    declared, unknown = [], []

    def walk(node, prefix: str) -> None:
        kind = OmegaConf.get_type(node)
        names = {f.name for f in fields(kind)} if is_dataclass(kind) else None
        for key in node.keys():
            if names is not None and key not in names:
                unknown.append(prefix + key)
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                walk(child, f"{prefix}{key}.")
            else:
                declared.append(prefix + key)

    walk(cfg, "")
    return declared, unknown


def no_such_key(key: str, declared: Sequence[str]) -> str:
    """`key`, with the declared key it was likely meant to be: the same name in another section
    (trainer.lr: optimizer.lr), else the nearest spelling (trainer.max_step: trainer.max_steps); a key with no
    dot, the nearest section or group (optimzer: optimizer)."""
    import difflib

    if "." in key:
        name = key.rsplit(".", 1)[-1]
        near = ([d for d in declared if d.rsplit(".", 1)[-1] == name]
                or difflib.get_close_matches(key, declared, n=1, cutoff=0.75))
    else:
        groups = {d.split(".")[0] for d in declared} | {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
        near = difflib.get_close_matches(key, sorted(g for g in groups if not g.startswith("_")), n=1, cutoff=0.75)
    return f"{key} (did you mean {near[0]}?)" if near else f"{key} (python -m trainloop --cfg job lists every key)"


def misspelt_keys(overrides: Sequence[str]) -> list[str]:
    """The keys of a command line Hydra refused that its sections do not declare, each as no_such_key gives it:
    Hydra's own message offers `+KEY=VALUE`, which check_complete refuses. The group choices compose alone."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = [o for o in OverridesParser.create().parse_overrides(list(overrides))
                  if not o.key_or_group.startswith("hydra")]
        groups = [o.input_line for o in parsed if (CONFIG_DIR / o.key_or_group).is_dir()]
        keys = [o.key_or_group for o in parsed if not (CONFIG_DIR / o.key_or_group).is_dir()]
        declared = keys_of(composed(groups, False))[0] if keys else []
    except Exception:  # noqa: BLE001 - Hydra has said what is wrong; this only adds a hint where it can
        return []
    sections = {d.split(".")[0] for d in declared}
    return [no_such_key(key, declared) for key in keys if key not in declared and key not in sections]


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # trainloop/
CONFIG_DIR = PACKAGE_DIR / "conf"
if not CONFIG_DIR.is_dir():  # a source checkout or editable install: conf/ beside the package
    CONFIG_DIR = PACKAGE_DIR.parent / "conf"

CHOICES = {
    "model.name": ("tiny", "hf"),
    "model.arch": ("llama", "gpt2", "mixtral", "llava"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2"),
    "model.quantization": ("none", "8bit", "4bit"),
    "adapter.name": ("none", "lora"),
    "data.packing": ("documents", "stream", "none"),
    "data.overlong": ("truncate", "drop", "split"),
    "data.multiprocessing_context": ("forkserver", "spawn", "fork"),
    "optimizer.impl": ("auto", "fused", "foreach", "for_loop"),
    "scheduler.name": ("cosine", "linear", "constant"),
    "precision.name": ("fp32", "bf16", "fp16", "fp8"),
    "trainer.on_nonfinite": ("skip", "stop"),
    "deepspeed.stage": (0, 1, 2, 3),
    "deepspeed.offload_optimizer": ("none", "cpu", "nvme"),
    "deepspeed.offload_param": ("none", "cpu", "nvme"),
    "fsdp.name": ("none", "full_shard"),
    "fsdp.offload": ("none", "cpu"),
    "compile.backend": ("none", "inductor", "aot_eager", "eager", "cudagraphs"),
    "compile.mode": ("default", "reduce-overhead", "max-autotune"),
    "logging.profile_ranks": ("main", "all"),
    "parallel.pp_schedule": ("1f1b", "gpipe", "interleaved_1f1b"),
}

POSITIVE = (
    "model.num_layers", "model.hidden_size", "model.num_heads", "model.max_position_embeddings",
    "model.vocab_multiple", "data.seq_len", "data.batch_size",
    "trainer.max_steps", "trainer.gradient_accumulation_steps", "trainer.log_every",
    "trainer.eval_every", "checkpoint.keep_last", "adapter.r", "adapter.alpha",
    "model.num_experts", "model.experts_per_token", "eval.max_new_tokens", "parallel.tp_size",
    "parallel.pp_size", "parallel.pp_stages_per_rank", "parallel.cp_size", "parallel.ep_size",
    "eval.harness.batch_size", "model.image_size", "model.patch_size", "model.vision_layers",
    "model.vision_hidden_size",
)


_TINY = (lambda c: c.model.name == "tiny", "model=tiny")
_ZERO = (lambda c: c.deepspeed.stage > 0, "deepspeed=zero1, zero2 or zero3")
_ZERO3 = (lambda c: c.deepspeed.stage == 3, "deepspeed=zero3")
_MIXTRAL = (lambda c: c.model.name == "tiny" and c.model.arch == "mixtral", "model=tiny and model.arch=mixtral")
_LLAVA = (lambda c: c.model.name == "tiny" and c.model.arch == "llava", "model=tiny and model.arch=llava")
_FSDP = (lambda c: c.fsdp.name != "none", "fsdp=full_shard (or +preset=fsdp)")
_LORA = (lambda c: c.adapter.name == "lora", "adapter=lora")
_COMPILED = (lambda c: c.compile.backend != "none", "compile=inductor (or another compile backend)")
_FP8 = (lambda c: c.precision.name == "fp8", "precision=fp8")

# Keys that only some choices read: KEY -> (does this config read it?, the choice that reads it).
# A key given on the command line that the composed config does not read is refused, so that
# `data.path=X` without data=files cannot train on something else and exit 0. The optimizer keys
# and the data-format keys come from their tables (read_only_by).
_READ_ONLY_BY = {
    "model.name_or_path": (lambda c: c.model.name == "hf", "model=hf"),
    "model.arch": _TINY,
    "model.num_layers": _TINY,
    "model.hidden_size": _TINY,
    "model.num_heads": _TINY,
    "model.num_kv_heads": _TINY,
    "model.tie_embeddings": _TINY,
    "model.intermediate_size": _TINY,
    "model.max_position_embeddings": _TINY,
    "model.dropout": _TINY,
    **{f"model.{key}": _MIXTRAL for key in ("num_experts", "experts_per_token", "router_aux_loss_coef")},
    **{f"model.{key}": _LLAVA for key in ("image_size", "patch_size", "vision_layers", "vision_hidden_size")},
    "model.freeze": (lambda c: c.data.name == "vision_chat", "data=vision_chat (a vision-language model)"),
    "model.quantization": (lambda c: c.model.name == "hf" and c.adapter.name == "lora", "model=hf and adapter=lora"),
    **{f"adapter.{key}": _LORA for key in ("r", "alpha", "dropout", "target_modules", "modules_to_save")},
    "data.overlong": (lambda c: c.data.packing != "stream", "data.packing=documents or none"),
    "data.multiprocessing_context": (lambda c: c.data.num_workers > 0, "data.num_workers > 0"),
    "trainer.auto_batch_size_budget_mb": (lambda c: c.trainer.auto_batch_size, "trainer.auto_batch_size=true"),
    **{f"deepspeed.{key}": _ZERO for key in (
        "offload_optimizer", "overlap_comm", "contiguous_gradients", "reduce_bucket_size",
        "allgather_bucket_size", "config_file")},
    **{f"deepspeed.{key}": _ZERO3 for key in (
        "offload_param", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "gather_16bit_weights_on_model_save", "zero3_init")},
    "deepspeed.nvme_path": (lambda c: "nvme" in (c.deepspeed.offload_optimizer, c.deepspeed.offload_param),
                            "deepspeed.offload_optimizer=nvme or deepspeed.offload_param=nvme"),
    **{f"fsdp.{key}": _FSDP for key in ("reshard_after_forward", "offload")},
    "fsdp.sync_each_batch": (lambda c: c.fsdp.name != "none" and c.trainer.gradient_accumulation_steps > 1,
                             "fsdp=full_shard with trainer.gradient_accumulation_steps > 1"),
    "precision.fp8_emulate": _FP8,
    "precision.fp8_skip_small": _FP8,
    "checkpoint.async_save": _FSDP,  # DCP's async_save: the other strategies save through accelerate
    **{f"compile.{key}": _COMPILED for key in ("mode", "fullgraph", "dynamic", "regional", "optimizer")},
    "logging.profile_ranks": (lambda c: c.logging.profile_steps is not None, "logging.profile_steps=[START,END]"),
    "eval.max_new_tokens": (lambda c: bool(c.eval.prompts), "eval.prompts=[...] (a list of prompts)"),
    "eval.images": (lambda c: bool(c.eval.prompts) and c.data.name == "vision_chat",
                    "data=vision_chat and eval.prompts=[...] (a prompt for each image)"),
    **{f"eval.harness.{key}": (lambda c: bool(c.eval.harness.tasks), "eval.harness.tasks=[...] (the harness's tasks)")
       for key in ("include_path", "every", "limit", "num_fewshot", "batch_size")},
}



def read_only_by() -> dict[str, tuple]:
    """_READ_ONLY_BY and, from trainloop/optim/optimizers.py's table, the optimizer keys not every optimizer reads;
    from trainloop/formats' table, the data keys not every data format reads; from trainloop/objectives',
    the objective keys; from trainloop/parallel's, the parallel keys a strategy reads only in some settings."""
    from trainloop.data.formats import read_only_by as data_read_only_by
    from trainloop.objectives import read_only_by as objective_read_only_by
    from trainloop.optim.optimizers import OFFLOAD_READS, OPTIMIZERS
    from trainloop.parallel import STRATEGIES

    table = {**_READ_ONLY_BY, **data_read_only_by(), **objective_read_only_by(),
             **{key: when for strategy in STRATEGIES.values() for key, when in strategy.read_when.items()}}
    for key in (f.name for f in fields(OptimizerConfig) if f.name != "name"):
        readers = tuple(name for name, spec in OPTIMIZERS.items() if key in spec.reads)
        if len(readers) == len(OPTIMIZERS) and key in OFFLOAD_READS:
            continue  # every optimizer reads it, DeepSpeed's CPU Adam too
        reader = "optimizer=" + " or ".join(readers)
        if key not in OFFLOAD_READS:
            reader += " and deepspeed.offload_optimizer=none (offloading steps DeepSpeed's CPU Adam)"

        def reads(c, key=key, readers=readers) -> bool:
            offloaded = c.deepspeed.stage > 0 and c.deepspeed.offload_optimizer != "none"
            return key in OFFLOAD_READS if offloaded else c.optimizer.name in readers

        table[f"optimizer.{key}"] = (reads, reader)
    table["optimizer.projector_lr"] = (lambda c: c.data.name == "vision_chat",
                                       "data=vision_chat (a vision-language model's projector)")
    return table


def choices() -> dict[str, tuple]:
    """CHOICES, with the optimizers and objectives from their tables (trainloop/optim/optimizers.py, trainloop/objectives)."""
    from trainloop.data.formats import FORMATS, train_on_choices
    from trainloop.objectives import OBJECTIVES
    from trainloop.optim.optimizers import OPTIMIZERS

    return {**CHOICES, "data.name": tuple(FORMATS), "data.train_on": train_on_choices(),
            "optimizer.name": tuple(OPTIMIZERS), "objective.name": tuple(OBJECTIVES)}


def command_line_keys(overrides: Sequence[str]) -> list[str]:
    """The config keys (not groups, not hydra.*) that command-line overrides set."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if "." in key and not key.startswith("hydra.") and not override.is_delete():
            keys.append(key)
    return keys


def preset_choices(name: str) -> dict[str, str]:
    """The options a preset file chooses for config groups (its `override /GROUP: OPTION` lines)."""
    from omegaconf import OmegaConf

    path = CONFIG_DIR / "preset" / f"{name}.yaml"
    if not path.is_file():  # Hydra names the unknown preset itself
        return {}
    return {key.split()[-1].lstrip("/"): option
            for entry in OmegaConf.load(path).get("defaults", []) for key, option in entry.items()}


def check_presets(overrides: Sequence[str]) -> None:
    """Presets given together must not choose different options of one group (deepspeed=zero3 and
    deepspeed=none, say): Hydra would keep the later one's and drop the other without a word.
    Keys that several presets set are another matter: the later preset's value counts, as the
    README says (+preset=[smoke,memory_saver] is smoke's sizes with memory_saver's batch)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    names = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.key_or_group == "preset" and not override.is_delete() and not override.is_sweep_override():
            value = override.value()
            names += value if isinstance(value, list) else [value]
    chosen: dict[str, tuple[str, str]] = {}
    for name in names:
        for group, option in preset_choices(str(name)).items():
            first, first_option = chosen.setdefault(group, (name, option))
            if first_option != option:
                raise ConfigError(f"+preset=[{first},{name}]: preset {first} sets {group}={first_option} and preset "
                                  f"{name} sets {group}={option}, so one of them would be dropped; choose one of the two")


def check_command_line(cfg: Any, overrides: Sequence[str]) -> None:
    """Refuse presets that contradict each other, and keys given on the command line that the
    chosen options do not read."""
    from omegaconf import OmegaConf

    check_presets(overrides)
    unread, table = [], read_only_by()
    for key in command_line_keys(overrides):
        reads, reader = table.get(key, (None, None))
        if reads is not None and not reads(cfg):
            unread.append(f"{key}={OmegaConf.select(cfg, key)} has no effect unless {reader}: "
                          f"choose that, or drop {key}")
    if unread:
        raise ConfigError("this run would ignore a key given on the command line:\n  " + "\n  ".join(unread))


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def profile_problems(cfg: Any) -> list[str]:
    """logging.profile_steps: [START, END], optimizer steps counted from 1, within the run."""
    window = cfg.logging.profile_steps
    if window is None:
        return []
    if len(window) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in window):
        return [f"logging.profile_steps={list(window)} must be two optimizer steps [START,END], e.g. [5,8]"]
    start, end = window
    if not 1 <= start <= end:
        return [f"logging.profile_steps=[{start},{end}] needs 1 <= START <= END (steps count from 1)"]
    if end > cfg.trainer.max_steps:
        return [f"logging.profile_steps=[{start},{end}] ends after trainer.max_steps={cfg.trainer.max_steps}: "
                "choose END <= trainer.max_steps"]
    return []


def validate(cfg: Any) -> None:
    """Check what the types cannot: choices, ranges and combinations. Raises ConfigError naming every problem."""
    found = problems(cfg)
    if found:
        raise ConfigError("invalid config:\n  " + "\n  ".join(found))


def problems(cfg: Any) -> list[str]:
    """What validate refuses, one line each (naming the key and what to do): choices, ranges and combinations.

    Each module states its own checks (model, adapter, data formats, objectives, strategies,
    trackers: their problems(cfg)); the compile and profiler keys are checked here because those
    modules import torch when loaded, and validating a config must stay quick."""
    from trainloop import objectives, parallel
    from trainloop.data import formats
    from trainloop.model import adapter, builder as model, fp8, vision
    from trainloop.observe import harness
    from trainloop.observe.trackers import tracker_problems
    from trainloop.optim.optimizers import TORCH_OPTIMIZERS

    found = []
    for key, allowed in choices().items():
        value = _get(cfg, key)
        if value not in allowed:
            found.append(f"{key}={value!r} is not one of: {', '.join(map(str, allowed))}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            found.append(f"{key}={_get(cfg, key)} must be greater than 0")
    for key in ("checkpoint.every_steps", "trainer.stop_at_step", "logging.peak_tflops", "trainer.eval_batches",
                "eval.harness.every", "eval.harness.limit", "optimizer.lr", "optimizer.projector_lr"):
        if _get(cfg, key) is not None and _get(cfg, key) <= 0:
            found.append(f"{key}={_get(cfg, key)} must be greater than 0, or null")

    found += model.problems(cfg)
    found += vision.problems(cfg)
    found += adapter.problems(cfg)
    found += fp8.problems(cfg)
    found += formats.problems(cfg)
    fmt = formats.FORMATS.get(cfg.data.name)
    found += objectives.problems(cfg, fmt)

    found += parallel.problems(cfg)
    c = cfg.compile
    if c.mode != "default" and c.backend != "inductor":
        found.append(f"compile.mode={c.mode} is an inductor setting; use compile=inductor "
                        f"(compile.backend is {c.backend})")
    if c.regional and c.backend == "none":
        found.append("compile.regional=true needs a compile backend: add compile=inductor")
    if c.optimizer and c.backend == "none":
        found.append("compile.optimizer=true needs a compile backend: add compile=inductor")
    if c.optimizer and cfg.optimizer.name not in TORCH_OPTIMIZERS:
        found.append(f"compile.optimizer=true compiles torch's own optimizers ({', '.join(TORCH_OPTIMIZERS)}); "
                     f"optimizer={cfg.optimizer.name} is not one: set compile.optimizer=false")
    found += profile_problems(cfg)
    found += tracker_problems(cfg.logging.trackers)
    found += harness.problems(cfg)
    budget = cfg.trainer.auto_batch_size_budget_mb
    if budget is not None and budget <= 0:
        found.append(f"trainer.auto_batch_size_budget_mb={budget} must be greater than 0, or null")
    return found
