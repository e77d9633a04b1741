"""What an objective answers: the loss of a batch, what it is normalised by, its metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table is read by config checks, which must not load torch: it is imported where used
    import torch

# what a model's training forward reads of a batch, where the batch has it: the token rows, the position ids of
# packed documents and the documents themselves (trainloop.model.attention), the mask of padded rows, and a
# vision-language model's images (data=vision_chat: what its image processor gives)
FORWARD_KEYS = ("input_ids", "position_ids", "documents", "attention_mask", "pixel_values", "image_grid_thw",
                "image_sizes")


@dataclass
class BatchLoss:
    """One training forward's loss. `summed` is summed over the batch's units (target tokens,
    pairs...); the step (trainloop.step) divides it by the step's units over every micro-batch and
    data-parallel rank (Objective.count), so each unit weighs the same however units fall into micro-batches.
    `penalty` is added as it is, once per forward (a mixture's router loss)."""

    summed: torch.Tensor
    penalty: torch.Tensor | None = None


class Objective:
    """A training objective: a row of trainloop.objectives.OBJECTIVES, chosen by `objective=NAME`.

    - count(batch): the units a batch's loss is summed over, read before any forward, so that a
      step's total (one reduce over its micro-batches and ranks) normalises every micro-batch.
    - batch_loss(model, batch): the BatchLoss of one training forward.
    - window(strategy): values for the train log line since the last one, over every rank; those
      named in `headline` are on screen too, the rest in metrics.jsonl and the trackers.
    - draws(step), step_batches(strategy, model, group, step): whether a step reads micro-batches
      from the data, and the micro-batches it trains on, made from those (objective=grpo generates
      completions for the prompts read); for most objectives, always and the ones read.
    - examples(): a few of what it trained on since the last train line, for an event=samples record.
    - eval_sums(model, batch): what an evaluation forward adds up, a float64 vector (by default the
      summed loss and its units); eval_values(total): the eval line's values from their sums over
      the validation split (evaluate() adds them up over this rank's batches and the ranks).

    The build (trainloop.build) asks two more things of it: `frozen_copy(model)`, before compile
    and sharding (a model the objective keeps unchanged, e.g. DPO's reference; None: none), and,
    once everything is built, `start(...)` with that copy prepared by the strategy.
    """

    name = ""
    pairs = False  # trains on preference pairs (a data format whose row says pairs), not on target tokens
    prompts = False  # trains on completions it generates for prompts (a data format whose row says prompts)
    unpaired = False  # trains on completions labelled desirable or not (a data format whose row says unpaired)
    images = False  # trains on rows with images too (a data format whose row says images: a vision-language model)
    # the dataclass of the objective.* keys it reads (beyond name), declared beside it with their defaults for
    # objective=NAME; trainloop/config/schema.py composes them. A key it does not declare is refused when given
    keys: type | None = None
    # KEY of reads() -> (does this config read it?, what makes it read): a key it reads only in some settings
    read_when: dict = {}
    chunks_loss = False  # reads trainer.loss_chunk_tokens: scores tokens through trainloop.objectives.chunked_loss
    head = "lm"  # what the model ends in: a key of trainloop.model.heads.HEADS (reward: "score", one scalar)
    sequences = 1  # sequences per item of the data: one forward's batch is data.batch_size x this
    headline: tuple[str, ...] = ()  # window() keys the progress bar and the log line show beside loss and lr
    # optimizer.lr for a pretrained model (model=hf) where the config sets none: the default of TRL's trainer
    # for the same objective (its config class, named in the start-up line); a model from scratch keeps 1e-3
    pretrained_lr: tuple[float, str] = (2e-5, "SFTConfig")
    # What its loss needs beyond the output of one forward of the model (forward_inputs'): trainloop.parallel.degrees'
    # words (FROZEN, SECOND_FORWARD, GENERATION, SCORE_HEAD), which a dimension that runs that forward itself (the
    # pipeline) checks against what it gives; () for that forward alone (causal_lm, simpo)
    needs: tuple[str, ...] = ()
    # its loss is the next-token loss on target tokens alone, which chunked_token_loss computes from the final hidden
    # states: what a layout that takes the chunked loss inside its forward (the pipeline's last stage) runs
    next_token_loss = False

    @classmethod
    def needs_in(cls, cfg) -> tuple[str, ...]:
        """`needs` in this config (a row that needs some only in some settings says which)."""
        return cls.needs

    @classmethod
    def copies_model(cls, cfg) -> bool:
        """Whether frozen_copy, in this config, is a copy of the model as built (a full fine-tune's reference):
        a layout that builds the model already partitioned (DeepSpeed's zero.Init) cannot give one."""
        return False

    @classmethod
    def reads(cls) -> tuple[str, ...]:
        """The objective.* keys it reads (beyond name): its keys'."""
        return tuple(f"objective.{key.name}" for key in fields(cls.keys)) if cls.keys else ()

    @staticmethod
    def problems(cfg) -> list[str]:
        """Its own config checks (the whole config), each naming the key and what to choose."""
        return []

    @staticmethod
    def memory_lines(plan, cfg) -> None:
        """The planner's lines for what the objective itself holds (trainloop.tools.plan), added
        after the strategy's model-state lines, which it may read (e.g. to hold a copy like them)."""

    def frozen_copy(self, model):
        """A copy of the model as built (before compile and sharding) that the objective keeps
        frozen, or None. The strategy shards it like the policy (Strategy.prepare_frozen)."""
        return None

    def frozen_flops(self, frozen, seq_len: int) -> float:
        """FLOPs per trained token of what the frozen model computes, which MFU counts beside the
        policy's training FLOPs (objective=distill's teacher forward); 0: none counted."""
        return 0.0

    def start(self, strategy, model, frozen, train_set, valid_set, run_dir) -> None:
        """Called once the run is built, before any step: `frozen` is frozen_copy's, prepared."""

    @staticmethod
    def prompt_tools(cfg) -> list[dict] | None:
        """The JSON schemas of the tools the model may call, rendered into the prompts; None: none."""
        return None

    def rank_state(self) -> dict | None:
        """What this rank's objective holds that the next steps read and a resume must give back
        (tensors, lists and dicts of them), saved with each checkpoint as objective_<rank>.pt; None: nothing."""
        return None

    def load_rank_state(self, state: dict) -> None:
        """Back from a checkpoint saved at the same world size: what rank_state returned."""

    def draws(self, step: int) -> bool:
        """Whether step `step` (the steps taken before it) reads new micro-batches from the data."""
        return True

    def step_batches(self, strategy, model, group: list[dict] | None, step: int) -> list[dict]:
        """The micro-batches step `step` trains on, made from the ones it read (None if it read none),
        before any is counted: the step normalises by the count of what this returns."""
        return group

    def examples(self) -> list[dict]:
        """[{"prompt": ..., "text": ..., more}] of what was trained on since the last train line."""
        return []

    def count(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        raise NotImplementedError

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        return loss_sums(self.batch_loss(model, batch).summed, self.count(batch))

    # -- the loss alone, for a layout that runs the forward itself (the pipeline's last stage) ----------------
    # Such a layout first asks beside(strategy, model, batch) for what the loss reads from other forwards, which it
    # runs through strategy.computed; then it runs the forward of forward_inputs(batch) and hands the objective's
    # own batch_loss and eval_sums, as the model, what returns that forward's output. With
    # trainer.loss_chunk_tokens the layout's last stage takes chunked_token_loss instead
    # (trainloop.objectives.layout_problems keeps the rest off).
    def forward_inputs(self, batch: dict) -> dict:
        """The inputs of the one forward of the model that batch_loss and eval_sums read: the token rows (and the
        position ids of packed documents, the mask of padded rows)."""
        return {key: batch[key] for key in FORWARD_KEYS if key in batch}

    def beside(self, strategy, model, batch: dict) -> dict:
        """The batch with what its loss reads from forwards without gradients other than forward_inputs' (a frozen
        copy's, the policy's own of other rows), each computed by strategy.computed, so that batch_loss and
        eval_sums read them from it instead of running them; the batch itself where it reads none."""
        return batch

    def chunked_token_loss(self, hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor,
                           chunk: int) -> torch.Tensor:
        """The next-token loss summed over the target tokens (fp32) from the final hidden states and the output
        layer's `weight` and `bias`, `chunk` tokens at a time (trainer.loss_chunk_tokens): the full logits never
        exist. Position t predicts labels[:, t + 1]."""
        from trainloop.objectives.chunked_loss import chunked_nll

        return chunked_nll(hidden, weight, bias, labels, chunk)

    def token_loss_sums(self, summed: torch.Tensor, batch: dict) -> torch.Tensor:
        """An evaluation forward's sums (eval_sums) from its chunked_token_loss."""
        return loss_sums(summed, self.count(batch))

    def eval_values(self, total: torch.Tensor) -> dict:
        eval_loss = (total[0] / total[1].clamp(min=1)).item()
        return {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}

    def window(self, strategy) -> dict:
        return {}

    def evaluate(self, strategy, model, loader, max_batches: int | None) -> dict:
        """The eval line's values over the validation split, identical on every rank. `loader` reads
        this rank's share in a trainloop.data.order.ValidationOrder, every item by one rank; max_batches
        (trainer.eval_batches) counts global batches. The micro-batches past its `counted` ones run
        their forward (a sharded model needs every rank in it) and are not counted."""
        import torch
        from accelerate.utils import send_to_device

        from trainloop.model.attention import ON_HOST

        order, device = loader.batch_sampler, strategy.device
        order.max_batches = max_batches  # read when the loader starts, in this process
        model.eval()
        try:
            with torch.no_grad():
                non_blocking = strategy.accelerator.non_blocking
                sums = torch.stack([strategy.eval_sums(self, model, send_to_device(b, device, non_blocking,
                                                                                  skip_keys=ON_HOST))
                                    for b in loader])
        finally:
            model.train()
        return self.eval_values(strategy.reduce_sum(sums[:order.counted].sum(0)))


def loss_sums(summed: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """An evaluation forward's sums when they are the summed loss and its units alone."""
    import torch

    return torch.stack([summed.double(), units.double()])


def not_yet(cfg, name: str) -> list[str]:
    """What objective=`name` refuses for now, each naming the key: a mixture's router loss (its forward's
    aux_loss would go unused) and the batch-size search (its trial forwards would count in the first log
    line's sums). The pipeline is refused by what the row `needs` (trainloop.objectives.layout_problems, said once)."""
    problems = []
    if cfg.model.name == "tiny" and cfg.model.arch == "mixtral":
        problems.append(f"objective={name} does not add a mixture's router loss (model.router_aux_loss_coef): "
                        "use model.arch=llama or gpt2")
    if cfg.trainer.auto_batch_size:
        problems.append(f"objective={name} does not search a batch size yet: set trainer.auto_batch_size=false")
    return problems
