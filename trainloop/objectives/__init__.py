"""Training objectives, one row each: what a step optimises and how it is evaluated.

The loop, the batch-size trials, the planner's measurement and the benchmarks all take their
loss from the objective the config names (`objective=NAME`), so a step is written once. A new
objective is one module with an Objective subclass (trainloop/objectives/base.py) and one row
here, plus conf/objective/NAME.yaml; docs/extending.md walks through it.
"""

from __future__ import annotations

from trainloop.objectives.base import BatchLoss, Objective
from trainloop.objectives.causal_lm import CausalLM
from trainloop.objectives.distill import Distill
from trainloop.objectives.dpo import DPO
from trainloop.objectives.grpo import GRPO
from trainloop.objectives.kto import KTO
from trainloop.objectives.orpo import ORPO
from trainloop.objectives.reward import Reward
from trainloop.objectives.simpo import SimPO

OBJECTIVES: dict[str, type[Objective]] = {
    "causal_lm": CausalLM,
    "dpo": DPO,
    "simpo": SimPO,
    "grpo": GRPO,
    "reward": Reward,
    "kto": KTO,
    "distill": Distill,
    "orpo": ORPO,
}

__all__ = ["OBJECTIVES", "BatchLoss", "Objective", "build_objective", "keys_read", "problems", "prompt_tools",
           "read_only_by", "row"]


def build_objective(cfg, device) -> Objective:
    """The objective the config names (`objective.name`, one of OBJECTIVES: trainloop.config.compose checks it)."""
    return OBJECTIVES[cfg.objective.name](cfg, device)


def row(cfg) -> type[Objective]:
    """The row of the objective the config names: what it declares (needs, head, items), before one is built."""
    return OBJECTIVES[cfg.objective.name]


def layout_problems(cfg, objective: type[Objective]) -> list[str]:
    """What the objective needs (its row's `needs`, `copies_model`) against what the chosen layout gives
    (trainloop.parallel's declarations): one line for each combination that cannot run, naming both."""
    from trainloop.parallel.degrees import builds_partitioned, one_forward_only

    found, needs = [], objective.needs_in(cfg)
    for key, layout, instead, gives in one_forward_only(cfg):
        if missing := [need for need in needs if need not in gives]:
            said = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
            found.append(f"{key} with objective={objective.name} needs {said}, which {layout} does not give yet (it "
                         f"hands the objective's loss the output of one forward of the model, and of forwards "
                         f"without gradients before it); {instead}")
        elif cfg.trainer.loss_chunk_tokens and not objective.next_token_loss:
            found.append(f"trainer.loss_chunk_tokens={cfg.trainer.loss_chunk_tokens} with {key} and objective="
                         f"{objective.name}: {layout} chunks the next-token loss alone (objective=causal_lm's) inside "
                         "its last stage; set trainer.loss_chunk_tokens=0")
    if (key := builds_partitioned(cfg)) and objective.copies_model(cfg):
        found.append(f"{key} with objective={objective.name} and adapter=none: the frozen reference is a copy of the "
                     "model as built, and zero.Init builds it already partitioned; set deepspeed.zero3_init=false "
                     "(the copy is then partitioned like the policy), or adapter=lora")
    return found


def prompt_tools(cfg) -> list[dict] | None:
    """The JSON schemas of the tools the objective lets the model call, which data=prompts renders into
    its conversations (objective=grpo's objective.tools); None for none."""
    return OBJECTIVES[cfg.objective.name].prompt_tools(cfg)


def keys_read(cfg) -> tuple[str, ...]:
    """objective.name and the objective.* keys its row reads in this config (less one it reads only in
    settings this config lacks): what a checkpoint's fingerprint records of the objective."""
    row = OBJECTIVES[cfg.objective.name]
    return ("objective.name", *(key for key in row.reads() if row.read_when.get(key, (lambda c: True,))[0](cfg)))


def read_only_by() -> dict[str, tuple]:
    """config.read_only_by's rows for the objective.* keys: KEY -> (does this config read it?, who reads it)."""
    always = (lambda c: True, "")
    table = {}
    for key in dict.fromkeys(key for objective in OBJECTIVES.values() for key in objective.reads()):
        readers = {name: row.read_when.get(key, always) for name, row in OBJECTIVES.items() if key in row.reads()}
        table[key] = (lambda c, readers=readers: c.objective.name in readers and readers[c.objective.name][0](c),
                      "objective=" + " or ".join(name + (f" with {when[1]}" if when[1] else "")
                                                 for name, when in readers.items()))
    return table


# The items that only some formats hold (their row says so): what an objective that trains on them
# says of other data, and what such data says of another objective.
WANTS = {"pairs": "objective={objective} trains on preference pairs, and data={data} holds none: set data=preference",
         "prompts": "objective={objective} trains on prompts alone, and data={data} holds none: set data=prompts",
         "unpaired": "objective={objective} trains on completions labelled desirable or not, and data={data} holds "
                     "none: set data=unpaired"}
HOLDS = {"pairs": "data={data} holds preference pairs, which objective={objective} does not train on: "
                  "set objective={readers}",
         "prompts": "data={data} holds prompts alone, which objective={objective} does not train on: "
                    "set objective={readers}",
         "unpaired": "data={data} holds completions labelled desirable or not, which objective={objective} does not "
                     "train on: set objective={readers}"}


def items(row) -> str | None:
    """What a data format's or an objective's row says its items are: pairs, prompts, unpaired (labelled
    completions), or None (token blocks)."""
    return "pairs" if row.pairs else "prompts" if row.prompts else "unpaired" if row.unpaired else None


def problems(cfg, data_format=None) -> list[str]:
    """The chosen objective's own checks, and whether the data (its format's row, trainloop.data.formats)
    holds what it trains on."""
    objective = OBJECTIVES.get(cfg.objective.name)
    if objective is None:  # refused with the other choices
        return []
    problems = objective.problems(cfg)
    problems += loss_chunk_problems(cfg, objective)
    problems += layout_problems(cfg, objective)
    wants, holds = items(objective), items(data_format) if data_format is not None else None
    names = {"objective": objective.name, "data": cfg.data.name}
    if wants is not None and wants != holds:
        problems.append(WANTS[wants].format(**names))
    if holds is not None and wants != holds:
        readers = " or ".join(name for name, row in OBJECTIVES.items() if items(row) == holds)
        problems.append(HOLDS[holds].format(**names, readers=readers))
    if data_format is not None and data_format.images and not objective.images:
        readers = " or ".join(name for name, row in OBJECTIVES.items() if row.images)
        problems.append(f"objective={objective.name} with data={cfg.data.name}: only objective={readers} trains on "
                        "images yet; choose it, or data without images")
    return problems


def loss_chunk_problems(cfg, objective: type[Objective]) -> list[str]:
    """trainer.loss_chunk_tokens: tokens per chunk (0: off), for an objective that reads it, on a
    model whose output layer is called once per forward (the chunked loss replaces its forward for
    the call: a whole-model compile would trace that and recompile every step)."""
    chunk = cfg.trainer.loss_chunk_tokens
    if chunk < 0:
        return [f"trainer.loss_chunk_tokens={chunk} must be 0 (the full logits) or the tokens per chunk"]
    if not chunk:
        return []
    problems = []
    if not objective.chunks_loss:
        readers = " or ".join(name for name, row in OBJECTIVES.items() if row.chunks_loss)
        problems.append(f"trainer.loss_chunk_tokens={chunk} is read by objective={readers} only for now "
                        f"(objective is {objective.name}): set trainer.loss_chunk_tokens=0")
    if cfg.compile.backend != "none" and not cfg.compile.regional:
        problems.append(f"trainer.loss_chunk_tokens={chunk} with compile={cfg.compile.backend} of the whole model: "
                        "the chunked loss swaps the output layer's forward for each call, which a whole-model "
                        "graph would trace and recompile; use compile.regional=true (the blocks only), or "
                        "trainer.loss_chunk_tokens=0")
    return problems
