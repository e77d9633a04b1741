"""Knowledge distillation from a teacher (objective=distill): the student (the model the config
builds) learns the teacher's next-token distribution at every target token, not only the token the
data holds, through the generalized Jensen-Shannon divergence of TRL 1.16 (GKDTrainer,
DistillationTrainer; trainloop/objectives/divergence.py): objective.beta 0 is the forward KL
(classic distillation), 1 the reverse KL (on-policy distillation's), between them the JSD, both
distributions at objective.temperature.

The teacher (objective.teacher=DIR: a Hugging Face causal LM with the student's tokenizer, of any
size, e.g. another run's RUN_DIR/final) is loaded in fp32, frozen and placed like the policy by the
strategy (whole under DDP, partitioned by ZeRO-3, sharded by FSDP2), counted by the planner and by
MFU (a forward per token), and never saved. With trainer.loss_chunk_tokens the divergence is taken
a chunk at a time from both output layers' inputs: neither model's full logits exist.

Off-policy (the default) it trains on the data's own tokens: any format of token blocks (text,
prompt/completion, chat), the targets as data.train_on marks them. On-policy, GKD's lambda
(objective.on_policy_fraction): that share of the steps, drawn from (trainer.seed, step) alike on
every rank, the student writes its own completion of each row's prompt (the row's tokens before its
first target: data.packing=none and a format with prompts), sampled at objective.temperature and
objective.top_p, up to objective.max_new_tokens, each row drawing from its own key, (trainer.seed,
step, the prompt's tokens; generation.RowDraws), and the teacher grades every token of it. A resumed
run, or one on another number of ranks, draws and samples what a straight one did. A batch's units are its target tokens: a step's loss is the mean over every
target token of the global batch (TRL's num_items_in_batch).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError
from trainloop.objectives.base import FORWARD_KEYS, BatchLoss, Objective, not_yet
from trainloop.parallel.degrees import FROZEN, GENERATION

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

log = logging.getLogger("trainloop")
KEY = "objective.teacher"
SHOWN = 2  # on-policy completions in each log interval's event=samples record
TEACHER_LOGITS = "teacher_logits"  # what Objective.beside puts in a batch: the teacher's forward's logits
# summed over a window or the validation split: divergence, target tokens, the student's and the teacher's
# cross-entropy, then (train only) on-policy micro-batches and micro-batches
SUMS = ("divergence", "tokens", "nll", "teacher_nll")


@dataclass
class DistillConfig:
    # the teacher: a directory transformers loads as a causal LM (e.g. a run's RUN_DIR/final), with the student's
    # tokenizer and vocabulary; loaded in fp32, frozen, placed and sharded like the student
    teacher: Optional[str] = None
    beta: float = 0.5  # the divergence: 0 forward KL(teacher || student), 1 reverse KL, between the generalized JSD
    temperature: float = 1.0  # both distributions' softmax temperature, and the on-policy sampling temperature
    # the share of steps on which the student writes the completions of the data's prompts (GKD's lambda): 0 trains
    # on the data's own completions alone, 1 on the student's alone
    on_policy_fraction: float = 0.0
    max_new_tokens: int = 128  # the longest on-policy completion
    top_p: float = 1.0  # on-policy sampling's nucleus mass, in (0, 1]


def teacher_problem(directory: str | None) -> str | None:
    """What keeps objective.teacher from naming a model directory, read without loading anything."""
    if directory is None:
        return (f"objective=distill needs {KEY}=DIR: a Hugging Face causal LM with the student's tokenizer, "
                "e.g. another run's RUN_DIR/final")
    path = Path(directory).expanduser()
    if not path.is_dir():
        return f"{KEY}={directory} is no directory: give a model's (a run's RUN_DIR/final, or a downloaded model)"
    if not (path / "config.json").is_file():
        return f"{KEY}={directory} holds no config.json: give a directory transformers saved a model in"
    return None


def prompt_lengths(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's prompt: its tokens before its first target (a token whose label is not IGNORE),
    or, a row without one, the whole row; at least its first token."""
    import torch

    targets = labels != IGNORE
    targets[:, 0] = False  # the first token is never predicted
    length = labels.shape[1] if attention_mask is None else attention_mask.sum(1)
    first = torch.where(targets.any(1), targets.int().argmax(1), torch.as_tensor(length, device=labels.device))
    return first.clamp(min=1)


class Distill(Objective):
    name = "distill"
    needs = (FROZEN, GENERATION)  # the teacher's forward; generation with objective.on_policy_fraction > 0
    pretrained_lr = (2e-05, "GKDConfig")
    keys = DistillConfig
    chunks_loss = True
    headline = ("nll",)
    read_when = {f"objective.{key}": (lambda c: c.objective.on_policy_fraction > 0, "objective.on_policy_fraction > 0")
                 for key in ("max_new_tokens", "top_p")}

    @classmethod
    def needs_in(cls, cfg) -> tuple[str, ...]:
        return cls.needs if cfg.objective.on_policy_fraction > 0 else (FROZEN,)

    def __init__(self, cfg, device):
        import torch

        from trainloop.data.tokenizer import build_tokenizer, pad_id
        from trainloop.objectives.generation import generation_config

        o = cfg.objective
        self.beta, self.temperature, self.fraction = o.beta, o.temperature, o.on_policy_fraction
        self.cfg, self.chunk, self.seed = cfg, cfg.trainer.loss_chunk_tokens, cfg.trainer.seed
        self.tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
        check_teacher(cfg, self.tokenizer)
        self.eos, self.pad = self.tokenizer.eos_token_id, pad_id(self.tokenizer)
        self.sampling = generation_config(do_sample=True, temperature=o.temperature, top_p=o.top_p, top_k=0,
                                          max_new_tokens=o.max_new_tokens, pad_token_id=self.pad, eos_token_id=self.eos,
                                          use_cache=True)
        self.device = torch.device(device)
        self.teacher, self.copy_head = None, False  # the teacher as the strategy placed it (start)
        self.sums = torch.zeros(len(SUMS) + 2, dtype=torch.float64, device=self.device)  # since the last train line
        self.shown: list[dict] = []

    @staticmethod
    def problems(cfg) -> list[str]:
        import math

        from trainloop.data.formats import FORMATS
        from trainloop.objectives.generation import length_problems

        o, problems = cfg.objective, []
        if (problem := teacher_problem(o.teacher)) is not None:
            problems.append(problem)
        if not 0 <= o.beta <= 1:
            problems.append(f"objective.beta={o.beta} must be in [0, 1] (0 forward KL, 1 reverse KL)")
        if not 0 < o.temperature < math.inf:
            problems.append(f"objective.temperature={o.temperature} must be greater than 0")
        if not 0 <= o.on_policy_fraction <= 1:
            problems.append(f"objective.on_policy_fraction={o.on_policy_fraction} must be in [0, 1]")
        if o.on_policy_fraction > 0:
            if not o.max_new_tokens > 0:
                problems.append(f"objective.max_new_tokens={o.max_new_tokens} must be greater than 0")
            if not 0 < o.top_p <= 1:
                problems.append(f"objective.top_p={o.top_p} must be in (0, 1]")
            fmt = FORMATS.get(cfg.data.name)  # an unknown one is refused with the other choices
            if fmt is not None and (not fmt.masked or cfg.data.train_on == "all"):
                problems.append(f"objective.on_policy_fraction={o.on_policy_fraction} completes each row's prompt, "
                                f"and data={cfg.data.name} with data.train_on={cfg.data.train_on} marks none (every "
                                "token is a target): use data=prompt_completion or chat with their default train_on")
            if cfg.data.packing != "none":
                problems.append(f"objective.on_policy_fraction={o.on_policy_fraction} completes each row's prompt, "
                                f"and data.packing={cfg.data.packing} puts several rows in one: set data.packing=none")
            if cfg.compile.backend != "none":
                problems.append("objective.on_policy_fraction > 0 generates with the model, which a compiled one "
                                "would recompile for each length: set compile=none, or on_policy_fraction=0")
            problems += length_problems(cfg)
        problems += not_yet(cfg, "distill")
        return problems

    @staticmethod
    def memory_lines(plan, cfg) -> None:
        """The teacher's weights, fp32 (the training precision under DeepSpeed), held as the strategy holds
        the policy's (whole, or 1/world per rank under ZeRO-3 and FSDP2), their size read from its safetensors
        headers; with the full logits, the teacher's logits in the forward."""
        import math

        from trainloop.objectives.rewards import saved_numel
        from trainloop.parallel import chosen, shards_weights
        from trainloop.parallel.memory import Line

        if teacher_problem(cfg.objective.teacher) is not None:
            return
        n, sharded = saved_numel(cfg.objective.teacher), shards_weights(cfg)
        width = 2 if chosen(cfg) == "zero" and cfg.precision.name in ("bf16", "fp16", "fp8") else 4
        held = math.ceil(n / plan.world_size) if sharded else n
        where = "gpu" if plan.device == "cuda" else "cpu"
        plan.lines.append(Line("teacher model", width * held, where,
                               note=f"{KEY}: {n / 1e6:,.1f}M parameters, {width} B each, frozen"
                                    + (f", 1/{plan.world_size} per rank" if sharded else ", whole on each rank")))
        if not cfg.trainer.loss_chunk_tokens:
            vocab = teacher_vocab(cfg.objective.teacher)
            plan.lines.append(Line("teacher logits", 4 * vocab * cfg.data.batch_size * cfg.data.seq_len, where,
                                   "forward/backward", exact=False,
                                   note="the teacher's full logits in each forward; trainer.loss_chunk_tokens takes "
                                        "them a chunk at a time"))

    # -- the teacher ----------------------------------------------------------------------------------
    def frozen_copy(self, model):
        """The teacher, loaded in fp32 (on the meta device where the student was built there: the
        strategy gives it the main process's weights), attending as the student does, frozen."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from trainloop.model.attention import SDPA_CAUSAL, SDPA_DOCUMENTS, register

        attention = self.cfg.model.attn_implementation
        if any(p.is_meta for p in model.parameters()):
            with torch.device("meta"):
                teacher = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.cfg.objective.teacher),
                                                           attn_implementation=attention, dtype=torch.float32)
        else:
            teacher = AutoModelForCausalLM.from_pretrained(self.cfg.objective.teacher, attn_implementation=attention,
                                                           dtype=torch.float32)
        student = getattr(model.config, "_attn_implementation", None)
        if student in (SDPA_CAUSAL, SDPA_DOCUMENTS):  # the rows are packed as the student reads them
            register()
            teacher.set_attn_implementation(student)
        teacher.config.use_cache = False
        return teacher.requires_grad_(False).eval()

    def frozen_flops(self, frozen, seq_len: int) -> float:
        """The teacher's forward per token: MFU counts it beside the student's training FLOPs."""
        from trainloop.model.flops import forward_flops_per_token

        return forward_flops_per_token(frozen.config, seq_len, model=frozen)

    def start(self, strategy, model, frozen, train_set, valid_set, run_dir) -> None:
        from trainloop.model.tensors import is_fsdp2

        self.teacher = frozen
        # ZeRO-3 and FSDP2 free the teacher's gathered output weight after its forward: the chunks read a copy
        self.copy_head = is_fsdp2(frozen) or getattr(frozen, "zero_optimization_stage", lambda: 0)() == 3
        log.info("objective=distill: the teacher %s, %s", self.cfg.objective.teacher, strategy.holds_frozen(frozen))

    # -- the step ----------------------------------------------------------------------------------
    def on_policy(self, step: int) -> bool:
        """Whether step `step` trains on the student's completions: drawn from (trainer.seed, step), the same
        on every rank, at the rate objective.on_policy_fraction."""
        from trainloop.objectives.generation import sampling_seed

        if self.fraction in (0, 1):
            return bool(self.fraction)
        return random.Random(sampling_seed(self.seed, step, -1, -1)).random() < self.fraction

    def step_batches(self, strategy, model, group: list[dict] | None, step: int) -> list[dict]:
        if not self.on_policy(step):
            return group
        batches = [self.sampled(strategy, model, batch, step) for batch in group]
        self.sums[len(SUMS)] += len(batches)
        return batches

    def sampled(self, strategy, model, batch: dict, step: int) -> dict:
        """The batch's rows with their prompts completed by the student (every rank taking part in every
        forward where the weights are sharded): the completion's tokens up to and with its end-of-text
        are the targets. Each completion draws from its own key, (trainer.seed, step, its prompt's
        tokens): the same on any number of ranks (two equal prompts in a step, the same completion)."""
        import torch

        from trainloop.objectives.generation import complete, completion_mask, content_keys, left_padded, row_keys
        from trainloop.objectives.generation import sampling

        ids, attention = batch["input_ids"], batch.get("attention_mask")
        lengths = prompt_lengths(batch["labels"], attention).tolist()
        prompt_ids, prompt_mask = left_padded([row[:n] for row, n in zip(ids.tolist(), lengths)], self.pad, ids)
        keys = row_keys(self.seed, step, content_keys(prompt_ids, prompt_mask))
        with sampling(strategy, model, seed=0) as module:  # the draws are the keys': the generator is only forked
            out = complete(module, prompt_ids, prompt_mask, self.sampling, "generate",
                           synced_gpus=strategy.world_size > 1, keys=keys)
        completion = out[:, prompt_ids.shape[1]:]
        mask = completion_mask(completion, self.eos)
        attention = torch.cat([prompt_mask, mask], 1)
        input_ids = torch.cat([prompt_ids, completion], 1)
        targets = torch.cat([torch.zeros_like(prompt_mask), mask], 1).bool()
        self.shown = [{"prompt": self.tokenizer.decode(p[m.bool()].tolist()),
                       "text": self.tokenizer.decode(c[k.bool()].tolist())}
                      for p, m, c, k in list(zip(prompt_ids, prompt_mask, completion, mask))[:SHOWN]]
        return {"input_ids": input_ids, "attention_mask": attention, "labels": input_ids.where(targets, IGNORE),
                "position_ids": (attention.cumsum(1) - 1).clamp(min=0)}

    def beside(self, strategy, model, batch: dict) -> dict:
        """The batch with the teacher's logits (TEACHER_LOGITS), its forward through strategy.computed."""
        from trainloop.model.attention import with_document_mask

        def logits(teacher):
            return teacher(**with_document_mask(teacher, self.forward_inputs(batch))).logits

        return batch | {TEACHER_LOGITS: strategy.computed(self, self.teacher, batch, logits)}

    def sums_of(self, model, batch: dict) -> torch.Tensor:
        """divergence_sums of the batch: [divergence (with its gradient), student cross-entropy, teacher's]."""
        from trainloop.model.forwarded import Forwarded
        from trainloop.objectives.divergence import divergence_sums

        inputs = {key: batch[key] for key in FORWARD_KEYS if key in batch} | {"use_cache": False}
        teacher = Forwarded(batch[TEACHER_LOGITS], batch["input_ids"]) if TEACHER_LOGITS in batch else self.teacher
        return divergence_sums(model, teacher, inputs, batch["labels"], self.beta, self.temperature, self.chunk,
                               self.copy_head)

    # -- the objective's contract ---------------------------------------------------------------------
    def count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE).sum()

    def totals(self, sums: torch.Tensor, batch: dict) -> torch.Tensor:
        """SUMS of a batch, float64: sums_of's with the target tokens counted after the divergence."""
        import torch

        sums = sums.detach().double()
        return torch.stack([sums[0], self.count(batch).double(), sums[1], sums[2]])

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        sums = self.sums_of(model, batch)
        self.sums[:len(SUMS)] += self.totals(sums, batch)
        self.sums[len(SUMS) + 1] += 1
        return BatchLoss(sums[0])

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        return self.totals(self.sums_of(model, batch), batch)

    @staticmethod
    def means(total) -> dict:
        import math

        tokens = max(total[1].item(), 1.0)
        nll, teacher_nll = total[2].item() / tokens, total[3].item() / tokens
        return {"nll": nll, "ppl": math.exp(min(nll, 50.0)), "teacher_nll": teacher_nll}

    def window(self, strategy) -> dict:
        total = strategy.reduce_computed(self.sums)
        self.sums = self.sums.new_zeros(self.sums.shape)
        values = self.means(total)
        if self.fraction > 0:
            values["on_policy_share"] = total[len(SUMS)].item() / max(total[len(SUMS) + 1].item(), 1.0)
        return values

    def eval_values(self, total: torch.Tensor) -> dict:
        values = self.means(total)
        return {"eval_loss": total[0].item() / max(total[1].item(), 1.0),
                **{f"eval_{key}": value for key, value in values.items()}}

    def examples(self) -> list[dict]:
        shown, self.shown = self.shown, []
        return shown


def teacher_vocab(directory: str) -> int:
    """The teacher's vocabulary size, from its config.json."""
    import json

    config = json.loads((Path(directory).expanduser() / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0))


def check_teacher(cfg, tokenizer) -> None:
    """Refuses, before any compute, a teacher whose next-token distributions cannot be compared with the
    student's token by token: another vocabulary size, or a tokenizer of its own that maps tokens to other ids."""
    from transformers import AutoTokenizer

    from trainloop.model.builder import build_model_config, special_token_ids

    directory = cfg.objective.teacher
    student = build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer)).vocab_size
    teacher = teacher_vocab(directory)
    if teacher != student:
        raise ConfigError(f"{KEY}={directory} has a vocabulary of {teacher} tokens and the student {student}: "
                          "distillation compares the two next-token distributions token by token; give a teacher "
                          "trained with the student's tokenizer (data.tokenizer)")
    path = Path(directory).expanduser()
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return  # no tokenizer of its own to compare: the vocabulary's size is all there is
    theirs = AutoTokenizer.from_pretrained(str(path)).get_vocab()
    ours = tokenizer.get_vocab()
    other = sum(1 for token, i in ours.items() if theirs.get(token) != i) + len(theirs.keys() - ours.keys())
    if other:
        raise ConfigError(f"{KEY}={directory}'s tokenizer maps {other} of {len(ours)} tokens otherwise than the "
                          f"student's (data.tokenizer={cfg.data.tokenizer}): give a teacher trained with the "
                          "student's tokenizer")
