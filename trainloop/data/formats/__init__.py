"""Data formats, one row each: which fields a format reads, what it can train on, whether its
labels carry a target mask, how it loads and tokenizes its rows (trainloop/data/formats/base.py).

config.py's choices for data.name and data.train_on and its "key is read only by" rows for the
data keys come from this table, `python -m trainloop.prepare` reads the keys of the formats that
tokenize, and trainloop.data.loaders builds from the row data.name names. A new format is one module with
a DataFormat subclass and one row here, plus conf/data/NAME.yaml; docs/extending.md walks through it.
"""

from __future__ import annotations

from trainloop.data.formats.base import TOKENIZING, DataFormat
from trainloop.data.formats.chat import Chat
from trainloop.data.formats.preference import Preference
from trainloop.data.formats.prepared import Prepared
from trainloop.data.formats.prompt_completion import PromptCompletion
from trainloop.data.formats.prompts import Prompts
from trainloop.data.formats.text import Files, Pydoc
from trainloop.data.formats.unpaired import Unpaired
from trainloop.data.formats.vision_chat import VisionChat

FORMATS: dict[str, DataFormat] = {
    "pydoc": Pydoc(),
    "files": Files(),
    "chat": Chat(),
    "vision_chat": VisionChat(),
    "prompt_completion": PromptCompletion(),
    "preference": Preference(),
    "unpaired": Unpaired(),
    "prompts": Prompts(),
    "prepared": Prepared(),
}

__all__ = ["FORMATS", "TOKENIZING", "DataFormat", "data_format", "problems", "read_only_by", "train_on_choices"]


def data_format(name: str) -> DataFormat:
    """The row of data.name (validate has refused a name that has none)."""
    return FORMATS[name]


def train_on_choices() -> tuple[str, ...]:
    """Every data.train_on value some format serves, in the table's order."""
    return tuple(dict.fromkeys(value for fmt in FORMATS.values() for value in fmt.train_on))


def _or(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def read_only_by() -> dict[str, tuple]:
    """config.read_only_by's rows for the data keys that some formats read and others do not:
    KEY -> (does this config read it?, the choice that reads it)."""
    table = {}
    for key in dict.fromkeys(key for fmt in FORMATS.values() for key in fmt.reads()):
        readers = [name for name, fmt in FORMATS.items() if key in fmt.reads()]
        if len(readers) == len(FORMATS):
            continue
        hints = "".join(f" (data={name}: {fmt.unread_hint(key)})" for name, fmt in FORMATS.items()
                        if name not in readers and fmt.unread_hint(key))
        table[key] = (lambda c, readers=tuple(readers): c.data.name in readers, f"data={_or(readers)}{hints}")
    return table


def source_problems(d) -> list[str]:
    """data.sources: a mixture replaces data.path; every weight a positive number."""
    if d.sources is None:
        return []
    if d.path:
        return [f"data.path={d.path} and data.sources are both set: a run reads one or the other; "
                "drop data.path, or data.sources=null"]
    if not d.sources:
        return ["data.sources=[] holds no source: give [{path: DIR, weight: W}, ...], or null"]
    problems = [f"data.sources[{i}].weight={s.weight} must be a number greater than 0"
                for i, s in enumerate(d.sources) if not s.weight > 0 or s.weight == float("inf")]
    names = [s.name or s.path for s in d.sources]
    if len(set(names)) < len(names):
        problems.append(f"data.sources names {names} repeat: give each source its own path or name")
    if d.persistent_workers:
        problems.append("data.persistent_workers=true with data.sources: persistent workers would keep the "
                        "first epoch's copy of the mixture's schedule; set data.persistent_workers=false")
    return problems


def problems(cfg) -> list[str]:
    """The data checks (config.validate collects them); data.name and data.train_on's choices are
    checked with the other choices."""
    d = cfg.data
    fmt = FORMATS.get(d.name)
    problems = []
    path = fmt.path if fmt is not None else DataFormat.path  # an unknown name (refused too): as data=files
    if path and not d.path and not d.sources:
        problems.append(f"data={d.name} needs data.path: {path} (or data.sources, a mixture)")
    problems += source_problems(d)
    serves = fmt.train_on if fmt is not None else ()
    if d.train_on in train_on_choices() and d.train_on not in serves:
        problems.append(f"data.train_on={d.train_on} cannot be served by data={d.name}: "
                        f"choose {' or '.join(serves)}")
    if not 0.0 < d.validation_fraction < 1.0:
        problems.append(f"data.validation_fraction={d.validation_fraction} must be in (0, 1)")
    if d.num_workers < 0:
        problems.append(f"data.num_workers={d.num_workers} must be 0 or more")
    if d.num_workers == 0 and (d.persistent_workers or d.prefetch_factor is not None):
        problems.append(
            "data.persistent_workers and data.prefetch_factor need data.num_workers > 0"
        )
    if fmt is not None:
        problems += fmt.problems(cfg)
    return problems
