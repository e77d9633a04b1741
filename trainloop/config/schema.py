"""The config's tree, composed from the keys each part declares beside its code.

Hydra merges conf/train.yaml and the chosen group options onto `TrainConfig`, so an unknown key
or a value of the wrong type fails while the config is composed (trainloop.config.compose). The
sections no row owns are in trainloop/config/sections.py. Each strategy declares its own section
(deepspeed, fsdp, parallel). Each objective and each data format declares a dataclass of the keys
it reads (its row's `keys`); their group's section holds the keys of every row, so that a key
another row reads is refused by name ("has no effect unless objective=grpo") rather than unknown,
and each objective's dataclass is registered as its option's schema (conf/objective/NAME.yaml
extends it), so its defaults are its own. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from omegaconf import MISSING

from trainloop.config import sections
from trainloop.config.sections import (
    AdapterConfig, CheckpointConfig, CompileConfig, EvalConfig, LoggingConfig, ModelConfig, OptimizerConfig,
    PrecisionConfig, SchedulerConfig, TrainerConfig)
from trainloop.data.formats import FORMATS
from trainloop.objectives import OBJECTIVES
from trainloop.parallel import STRATEGIES
from trainloop.parallel.base import ParallelKeys
from trainloop.parallel.deepspeed_config import DeepSpeedConfig
from trainloop.parallel.fsdp2 import FsdpConfig


def _field(declared: dataclasses.Field, default=MISSING):
    """A copy of a declared field for another dataclass, with `default` in place of its own if given."""
    if default is not MISSING:
        return field(default=default)
    if declared.default_factory is not dataclasses.MISSING:
        return field(default_factory=declared.default_factory)
    return field(default=declared.default)


def union(name: str, base: type, rows: dict[str, type | None]) -> type:
    """`base`'s section with every row's keys after its own, in the table's order. A key that several
    rows declare is one key: the same type in each, the first row's default. `declared_by` says who
    declares each key: {key: [(row, dataclass), ...]} (the generated reference reads their comments)."""
    declared_by = {f.name: [("", base)] for f in dataclasses.fields(base)}
    keys, types = [], {}
    for row, declaring in rows.items():
        if declaring is None:
            continue
        hints = typing.get_type_hints(declaring)
        for f in dataclasses.fields(declaring):
            if f.name in declared_by and declared_by[f.name][0][0] == "":
                raise TypeError(f"{declaring.__name__}.{f.name}: {base.__name__} declares it for every row")
            if f.name in types and types[f.name] != hints[f.name]:
                raise TypeError(f"{declaring.__name__}.{f.name} is {hints[f.name]}, "
                                f"and another row's is {types[f.name]}")
            if f.name not in types:
                types[f.name] = hints[f.name]
                keys.append((f.name, hints[f.name], _field(f)))
            declared_by.setdefault(f.name, []).append((row, declaring))
    section = dataclasses.make_dataclass(name, keys, bases=(base,))
    section.__module__, section.__doc__ = __name__, base.__doc__
    section.declared_by = declared_by
    return section


def with_defaults(section: type, row: str, declaring: type | None) -> type:
    """`section` with the defaults of one row's keys and its name: the schema of its option."""
    own = {f.name: f for f in dataclasses.fields(declaring)} if declaring else {}
    keys = [(f.name, f.type, _field(own.get(f.name, f), row if f.name == "name" else MISSING))
            for f in dataclasses.fields(section)]
    option = dataclasses.make_dataclass(section.__name__, keys, bases=(section,))
    option.__module__ = __name__
    return option


@dataclass
class ObjectiveKeys:
    """What a step optimises: a row of trainloop/objectives, each declaring the objective.* keys it reads."""

    name: str = "causal_lm"  # what a step optimises: a row of trainloop.objectives.OBJECTIVES (causal_lm: the next-token loss)


ParallelConfig = union("ParallelConfig", ParallelKeys, {name: row.keys for name, row in STRATEGIES.items()})
ObjectiveConfig = union("ObjectiveConfig", ObjectiveKeys, {name: row.keys for name, row in OBJECTIVES.items()})
DataConfig = union("DataConfig", sections.DataConfig, {name: fmt.keys for name, fmt in FORMATS.items()})

# group -> {option: the schema its conf/GROUP/OPTION.yaml extends}, registered by trainloop.config.compose
OPTION_SCHEMAS = {"objective": {name: with_defaults(ObjectiveConfig, name, row.keys)
                                for name, row in OBJECTIVES.items()}}


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    adapter: AdapterConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    precision: PrecisionConfig = MISSING
    deepspeed: DeepSpeedConfig = MISSING
    fsdp: FsdpConfig = MISSING
    compile: CompileConfig = MISSING
    objective: ObjectiveConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
