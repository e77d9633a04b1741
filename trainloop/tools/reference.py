"""`python -m trainloop.reference [--write [PATH] | --check]`: the config reference, generated.

Every key comes from the structured configs trainloop/config/schema.py composes: its type from
the annotation, its description from the comment on the field's line (or the comment lines right
above it) in the module that declares it (a row's keys beside the row's code, each said with the
option that reads it), its allowed values from config.choices() / config.POSITIVE, and its default
from the config `python -m trainloop` composes with no arguments. The options of each group and the
presets come from conf/<group>/*.yaml and their leading comments; an option whose row declares its
keys (objective) sets those keys' defaults. docs/config-reference.md is
this output; tests/test_reference.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

from omegaconf import OmegaConf

from trainloop.config import compose as config_module, schema
from trainloop.config.compose import CONFIG_DIR, POSITIVE, TrainConfig, choices
from trainloop.config.schema import OPTION_SCHEMAS

DOCS_FILE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def field_docs(source: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(class name, field name) -> (annotation as written, description from its comments)."""
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    docs = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not isinstance(node, ast.AnnAssign):
                continue
            text = " ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments)
            above = node.lineno - 1
            while not text and above in comments and lines[above - 1].lstrip().startswith("#"):
                above -= 1  # no trailing comment: the comment block right above the field
            if not text:
                text = " ".join(comments[n] for n in range(above + 1, node.lineno))
            docs[cls.name, node.target.id] = (ast.unparse(node.annotation), text)
    return docs


@functools.cache
def module_docs(path: str) -> dict[tuple[str, str], tuple[str, str]]:
    return field_docs(Path(path).read_text())


def class_docs(cls: type) -> dict[str, tuple[str, str]]:
    """A dataclass's field -> (annotation as written, description), read in the module of the class
    (itself or a base) that declares each field."""
    docs = {}
    for klass in reversed(cls.__mro__):
        own = vars(klass).get("__annotations__", {})
        if own and dataclasses.is_dataclass(klass):
            found = module_docs(inspect.getsourcefile(klass))
            docs.update({name: found[klass.__name__, name] for name in own})
    return docs


def either(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def key_docs(group: str, section: type) -> dict[str, tuple[str, str]]:
    """What key_docs says of each key of a section; a key rows declare (schema.union) is said with the
    option of each row that reads it: `objective=dpo: ...; objective=simpo: ...`."""
    declared_by = getattr(section, "declared_by", None)
    if declared_by is None:
        return class_docs(section)
    docs = {}
    for key, rows in declared_by.items():
        said: dict[str, list[str]] = {}
        for row, declaring in rows:
            annotation, text = class_docs(declaring)[key]
            said.setdefault(text, []).append(row)
        docs[key] = (annotation, "; ".join(text if readers == [""] else f"{group}={either(readers)}: {text}"
                                           for text, readers in said.items()))
    return docs


def option_keys(group: str, section: type, option: str) -> str:
    """What an option whose row declares its keys sets: its default of each of them."""
    defaults = OmegaConf.to_container(OmegaConf.structured(OPTION_SCHEMAS[group][option]))
    declaring = next((cls for rows in section.declared_by.values() for row, cls in rows if row == option), None)
    keys = [f.name for f in dataclasses.fields(declaring)] if declaring else []
    return ", ".join(f"`{group}.{key}={yaml_value(defaults[key])}`" for key in keys) or "(no key of its own)"


def type_name(annotation: str) -> str:
    if annotation.startswith("Optional[") and annotation.endswith("]"):
        return f"{type_name(annotation[9:-1])} or null"
    if annotation.startswith("list[") and annotation.endswith("]"):
        return f"list of {annotation[5:-1]}"
    return annotation


def yaml_value(value) -> str:
    """A value as it is written on the command line or in YAML."""
    if value == "???":
        return "??? (required)"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(yaml_value, value)) + "]"
    return str(value)


def describe(text: str) -> str:
    return re.sub(r"\bNone\b", "null", text)  # the comments speak Python; users write YAML


def default_config():
    """The config `python -m trainloop` runs with no arguments."""
    cfg = config_module.compose_config(check=False, return_hydra_config=True)
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    return cfg, choices


def leading_comment(path: Path) -> str:
    """The comment lines a YAML file starts with (Hydra's `@package` line left out)."""
    text = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            text.append(line.lstrip("#").strip())
    return " ".join(text)


def settings(path: Path, skip: tuple[str, ...] = ("name",)) -> str:
    """What a group option or preset sets, as `key=value` (group choices as `group=option`)."""
    data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    items = []
    for entry in data.pop("defaults", []):
        for group, option in (entry.items() if isinstance(entry, dict) else []):
            items.append(f"{group.replace('override ', '').lstrip('/')}={option}")

    def flatten(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                flatten(value, f"{prefix}{key}.")
            elif f"{prefix}{key}" not in skip:
                items.append(f"{prefix}{key}={yaml_value(value)}")

    flatten(data)
    return ", ".join(f"`{item}`" for item in items) or "(the defaults)"


def allowed(key: str) -> str:
    if key in choices():
        return ", ".join(f"`{c}`" for c in choices()[key])
    return "> 0" if key in POSITIVE else ""


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def optimizer_table(defaults) -> list[str]:
    """What trainloop/optim/optimizers.py's table says of each optimizer."""
    from trainloop.optim.optimizers import OPTIMIZERS, planned_state_bytes

    yes = {True: "yes", False: "no"}
    matrix = (4096, 4096)
    out = ["What each optimizer keeps and works with (trainloop/optim/optimizers.py's table; state in bytes per",
           "element of a 4096 x 4096 fp32 matrix, with this page's defaults):", "",
           "| optimizer | state B/param | reads | deepspeed.offload_optimizer | deepspeed=zero1/2 | deepspeed=zero3 "
           "| fsdp=full_shard | CUDA only |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, spec in OPTIMIZERS.items():
        cfg = OmegaConf.merge(defaults, {"name": name})
        per_param = planned_state_bytes(cfg, [matrix]) / (matrix[0] * matrix[1])
        reads = ", ".join(f"`{key}`" for key in spec.reads)
        out.append(f"| `{name}` | {per_param:.3g} | {reads} | {yes[spec.cpu_offload]} | {yes[spec.zero]} | {yes[spec.zero3]} | "
                   f"{yes[spec.fsdp2]} | {yes[spec.cuda_only]} |")
    return out + [""]


def key_rows(prefix: str, cls: type, docs: dict, defaults: dict) -> list[str]:
    """The table's row of each key of a section; a section inside it (eval.harness) gives its keys' rows."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out += key_rows(key, hints[f.name], class_docs(hints[f.name]), defaults[f.name])
            continue
        annotation, text = docs[f.name]
        out.append(f"| `{key}` | {cell(type_name(annotation))} | `{cell(yaml_value(defaults[f.name]))}` | "
                   f"{allowed(key)} | {cell(describe(text))} |")
    return out


def render() -> str:
    cfg, choices = default_config()
    groups = [f for f in dataclasses.fields(TrainConfig)]
    out = [
        "# Config reference",
        "",
        "<!-- Generated by `python -m trainloop.reference --write` from trainloop/config/compose.py and conf/;",
        "     do not edit by hand: tests/test_reference.py fails when this file is stale. -->",
        "",
        "Every key trainloop reads, with its type, its default (what `python -m trainloop` runs with",
        "no arguments) and what it does. Set a key with `KEY=VALUE`, choose a group's option with",
        "`GROUP=OPTION`, add a preset with `+preset=NAME`; `python -m trainloop --cfg job` prints",
        "the composed config. Unknown keys (`+KEY=VALUE` too, which Hydra lets add any key) and values",
        "of the wrong type are refused when the config is composed, an unknown key with the nearest",
        "known one; the allowed values and ranges below are checked before anything is built.",
        "",
        "Groups: " + ", ".join(f"[{g.name}](#{g.name})" for g in groups) + ", [presets](#presets).",
    ]
    for group in groups:
        cls = group.type if isinstance(group.type, type) else getattr(schema, group.type)
        out += ["", f"## {group.name}", ""]
        folder = CONFIG_DIR / group.name
        if folder.is_dir():
            out += [f"Options (`{group.name}=OPTION`, files in conf/{group.name}/); "
                    f"the default is `{choices.get(group.name)}`.", "",
                    "| option | what it is | sets |", "| --- | --- | --- |"]
            for path in sorted(folder.glob("*.yaml")):
                sets = option_keys(group.name, cls, path.stem) if group.name in OPTION_SCHEMAS else settings(path)
                out.append(f"| `{path.stem}` | {cell(leading_comment(path))} | {cell(sets)} |")
            out.append("")
            if group.name == "optimizer":
                out += optimizer_table(cfg.optimizer)
        out += ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
        out += key_rows(group.name, cls, key_docs(group.name, cls), OmegaConf.to_container(cfg[group.name]))
    out += ["", "## presets", "",
            "Bundles on top of the defaults, each one file in conf/preset/: `+preset=NAME`.", "",
            "| preset | what it is | sets |", "| --- | --- | --- |"]
    for path in sorted((CONFIG_DIR / "preset").glob("*.yaml")):
        out.append(f"| `{path.stem}` | {cell(leading_comment(path))} | {cell(settings(path, skip=()))} |")
    return "\n".join(out + matrix()) + "\n"


# The layouts of the objective x layout table, as a user sets them (the process count is the launcher's: 2, or
# 2 x 2 for HSDP and FSDP2 x TP)
LAYOUTS = {"DDP": [], "ZeRO-3": ["deepspeed=zero3"], "FSDP2": ["fsdp=full_shard"],
           "HSDP": ["fsdp=full_shard", "parallel.dp_replicate=2"], "FSDP2 x TP": ["fsdp=full_shard", "parallel.tp_size=2"],
           "pipeline": ["parallel.pp_size=2", "model.tie_embeddings=false", "trainer.gradient_accumulation_steps=2"],
           "context parallel": ["parallel.cp_size=2"]}


def matrix() -> list[str]:
    """Which objective runs on which layout, read from the declarations: for each objective (on the data format
    that holds its items, trainloop.objectives.items), what validate says of the layout that it does not say
    without one: nothing ("yes"), or each refusal, which names the reason."""
    from trainloop.config.compose import compose_config, problems
    from trainloop.data.formats import FORMATS
    from trainloop.objectives import OBJECTIVES, items

    out = ["", "## objectives and layouts", "",
           "Generated from each objective's declarations (`needs`, `copies_model`, its checks) and each layout's:",
           "what `validate` refuses for the layout that it does not refuse without one.", "",
           "| objective | " + " | ".join(LAYOUTS) + " |", "|---" * (len(LAYOUTS) + 1) + "|"]
    for name, row in OBJECTIVES.items():
        data = next((f"data={fmt}" for fmt, f in FORMATS.items() if items(f) == items(row) is not None), None)
        base = [f"objective={name}", *([data] if data else [])]
        alone = set(problems(compose_config(base, check=False)))
        cells = []
        for overrides in LAYOUTS.values():
            refused = [p for p in problems(compose_config([*base, *overrides], check=False)) if p not in alone]
            cells.append("yes" if not refused else "no: " + cell("; ".join(refused)))
        out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainloop.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--write", nargs="?", const=DOCS_FILE, type=Path, metavar="PATH",
                        help=f"write the reference to PATH (default: {DOCS_FILE})")
    parser.add_argument("--check", nargs="?", const=DOCS_FILE, type=Path, metavar="PATH",
                        help=f"exit 1 if PATH (default: {DOCS_FILE}) is not the current reference")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.check.is_file() or args.check.read_text() != text:
            print(f"{args.check} is stale: run python -m trainloop.reference --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
