"""Direct preference optimisation on preference pairs (data=preference): the policy's log-ratio
to a reference on the chosen completion against the rejected one, as TRL 1.16's DPOTrainer
computes it (`_compute_loss`): objective.loss_type sigmoid (the DPO paper's), ipo (its log-ratios
averaged over the completion's tokens, as TRL has it), hinge, or robust (objective.label_smoothing).

The reference is the starting model, frozen. With adapter=lora it is the policy with its adapters
disabled: no second copy. A full fine-tune keeps a frozen copy of the model as built, which the
strategy shards like the policy (ZeRO-3, FSDP2) and which no optimizer or checkpoint sees. With
objective.precompute_reference=true the reference's log-probabilities of every pair are computed in
one pass before training by the policy itself (before its first step it is the reference), carried
by the data from then on (and kept in RUN_DIR/reference_logps.pt, so a resumed run reads them
back): no copy is made. Chosen and rejected go through the model
in one forward, concatenated on the batch dimension. A batch's units are its pairs, so a step's loss
is the mean over the pairs of the global batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainloop.objectives.base import not_yet
from trainloop.objectives.pairs import PairObjective, completion_logps, sums
from trainloop.objectives.reference import as_reference, plan_copy, reference_forward
from trainloop.parallel.degrees import FROZEN

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

log = logging.getLogger("trainloop")
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
PRECOMPUTED = "reference_logps"  # the data's column of precomputed reference log-probs: [pairs, 2] (chosen, rejected)
CACHE = "reference_logps.pt"  # in the run dir


@dataclass
class DPOConfig:
    beta: float = 0.1  # how far the policy may move from the reference: the rewards are beta x log-ratios
    loss_type: str = "sigmoid"  # sigmoid (the DPO paper's), ipo, hinge, or robust (reads label_smoothing), as TRL 1.16 defines them
    label_smoothing: float = 0.0  # with loss_type=robust: the assumed share of flipped labels, in [0, 0.5)
    # the reference's log-probabilities of every pair computed in one pass before training (kept in
    # RUN_DIR/reference_logps.pt for a resume), and a full fine-tune's frozen reference copy freed after it
    precompute_reference: bool = False

def pair_tensors(dataset) -> dict:
    """A preference set's own columns (trainloop.data.sets.PairBlocks), without precomputed ones."""
    return {key: t for key, t in dataset.tensors.items() if key != PRECOMPUTED}


class DPO(PairObjective):
    name = "dpo"
    needs = (FROZEN,)
    pretrained_lr = (1e-06, "DPOConfig")
    keys = DPOConfig

    @classmethod
    def needs_in(cls, cfg) -> tuple[str, ...]:
        """Nothing beyond one forward with objective.precompute_reference: the data carries the reference's
        log-probabilities, computed before the first step through the layout's own forward (Strategy.computed)."""
        return () if cfg.objective.precompute_reference else cls.needs

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        o = cfg.objective
        self.beta, self.loss_type, self.label_smoothing = o.beta, o.loss_type, o.label_smoothing
        self.cfg = cfg
        self.frozen = None  # a full fine-tune's reference copy, until its log-probs are precomputed

    @staticmethod
    def problems(cfg) -> list[str]:
        o, problems = cfg.objective, []
        if o.loss_type not in LOSS_TYPES:
            problems.append(f"objective.loss_type={o.loss_type} is not one of: {', '.join(LOSS_TYPES)}")
        if not o.beta > 0:
            problems.append(f"objective.beta={o.beta} must be greater than 0")
        if o.loss_type == "robust" and not 0.0 <= o.label_smoothing < 0.5:
            problems.append(f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
        if o.loss_type != "robust" and o.label_smoothing != 0.0:
            problems.append(f"objective.label_smoothing={o.label_smoothing} is read only by objective.loss_type=robust "
                            f"(objective.loss_type is {o.loss_type}): choose robust, or drop it")
        problems += not_yet(cfg, "dpo")
        return problems

    @staticmethod
    def memory_lines(plan, cfg) -> None:
        """A full fine-tune's reference copy: the policy's parameters once more, held as the strategy
        holds them (whole, partitioned by ZeRO-3, sharded by FSDP2), in its precision; none with
        objective.precompute_reference."""
        if cfg.adapter.name != "none":
            plan.notes.append("objective=dpo with an adapter: the reference is the model with its adapters disabled, "
                              "no copy")
            return
        if cfg.objective.precompute_reference:
            plan.notes.append("objective.precompute_reference: no reference copy; the policy scores every pair "
                              "before its first step")
            return
        plan_copy(plan, "objective=dpo")

    # -- the reference -----------------------------------------------------------------------------
    @classmethod
    def copies_model(cls, cfg) -> bool:
        return cfg.adapter.name == "none" and not cfg.objective.precompute_reference

    def frozen_copy(self, model):
        """A full fine-tune's reference: the model as built (pretrained or initialised), frozen. None
        with an adapter (the policy with its adapters disabled) or objective.precompute_reference
        (the policy before its first step is the reference: it scores every pair in start())."""
        if not self.copies_model(self.cfg):
            return None
        import copy

        return copy.deepcopy(model).requires_grad_(False)

    def start(self, strategy, model, frozen, train_set, valid_set, run_dir) -> None:
        """Keep the reference copy; or, with objective.precompute_reference, put the reference's
        log-probabilities into the data, computed by the policy before its first step (adapters
        disabled), or read back from the run dir when a resumed run has them."""
        self.frozen = frozen
        if frozen is not None:
            log.info("objective=dpo: the reference is a frozen copy of the starting model, %s",
                     strategy.holds_frozen(frozen))
        if not self.cfg.objective.precompute_reference:
            return
        from pathlib import Path

        import torch

        sets = {"train": train_set, "valid": valid_set}
        key = self.reference_key(sets)
        path = None if run_dir is None else Path(run_dir) / CACHE
        saved = torch.load(path, map_location="cpu") if path is not None and path.is_file() else None
        ready = torch.tensor(float(saved is not None and saved["key"] == key), device=strategy.device)
        if strategy.sum_over_all(ready).item() == strategy.world_size:  # every rank reads the same file
            for name, dataset in sets.items():
                dataset.tensors[PRECOMPUTED] = saved[name]
            log.info("objective.precompute_reference: the reference's log-probabilities of %d + %d pairs read "
                     "from %s", len(train_set), len(valid_set), path)
        else:
            computed = {name: self.precompute(strategy, model, dataset) for name, dataset in sets.items()}
            for name, dataset in sets.items():
                dataset.tensors[PRECOMPUTED] = computed[name]
            if path is not None and strategy.accelerator.is_main_process:
                partial = path.with_suffix(".partial")
                torch.save({"key": key, **computed}, partial)
                partial.replace(path)
            log.info("objective.precompute_reference: the reference's log-probabilities of %d + %d pairs computed "
                     "in one pass%s", len(train_set), len(valid_set), "" if path is None else f", kept in {path}")

    def reference_key(self, sets: dict) -> str:
        """What the precomputed log-probabilities depend on: the pairs' tokens and the reference
        (the model as configured, its precision and, for a drawn initialisation, the seed)."""
        import hashlib

        from omegaconf import OmegaConf

        digest = hashlib.sha256()
        for name, dataset in sets.items():
            for column, tensor in sorted(pair_tensors(dataset).items()):
                digest.update(f"{name}/{column}{tuple(tensor.shape)}".encode())
                digest.update(tensor.numpy().tobytes())
        c = self.cfg
        digest.update(OmegaConf.to_yaml(c.model).encode())
        digest.update(f"{c.adapter.name} {c.precision.name} {c.trainer.seed}".encode())
        return digest.hexdigest()

    def precompute(self, strategy, model, dataset) -> torch.Tensor:
        """The reference's (chosen, rejected) log-probabilities of every pair of `dataset`, as float32
        [pairs, 2] on the CPU, from the policy before its first step (its adapters disabled), in eval mode,
        through the layout's own forward (Strategy.computed: the pipeline's stages too): each data-parallel
        rank computes every dp_size-th pair in batches of data.batch_size, every rank running the same
        number of forwards (a sharded model needs all of them in each), and the shares are summed."""
        import math

        import torch

        n, size, rank = len(dataset), strategy.dp_size, strategy.dp_rank
        batch_size = self.cfg.data.batch_size
        mine = list(range(rank, n, size))
        out = torch.zeros(n, 2, dtype=torch.float64, device=strategy.device)
        with as_reference(model, self.cfg.adapter.name != "none"):
            for r in range(math.ceil(math.ceil(n / size) / batch_size)):
                index = mine[r * batch_size:(r + 1) * batch_size]
                batch = {key: t[index or [0]].to(strategy.device) for key, t in pair_tensors(dataset).items()}
                logps = strategy.computed(self, model, batch,  # a rank out of pairs: one it will not keep
                                          lambda forward: completion_logps(forward, batch, self.chunk)[0])
                if index:
                    out[index] = torch.stack(logps.chunk(2), dim=1).double()
        return strategy.reduce_sum(out).float().cpu()

    def beside(self, strategy, model, batch: dict) -> dict:
        """The batch with the reference's log-probabilities of its pairs, as precomputed ones are carried (those
        stay): the frozen copy's forward, or the policy's with its adapters disabled, through strategy.computed."""
        import torch

        if PRECOMPUTED in batch:
            return batch

        def reference(forward) -> torch.Tensor:
            return completion_logps(forward, batch, self.chunk)[0]

        with reference_forward(model, self.frozen) as frozen:
            logps = strategy.computed(self, frozen, batch, reference)
        return batch | {PRECOMPUTED: torch.stack(logps.chunk(2), dim=1)}

    def reference_logps(self, model, batch: dict) -> torch.Tensor:
        """The reference's summed completion log-probabilities, chosen rows then rejected: precomputed
        and carried by the batch, or from the frozen copy, or from the policy with its adapters off.
        In eval mode, without gradients: the same reference every step."""
        if PRECOMPUTED in batch:
            return batch[PRECOMPUTED].T.reshape(-1)
        if self.frozen is None and self.cfg.adapter.name == "none":
            raise RuntimeError("objective=dpo: a full fine-tune's policy is its reference only before its first step")
        with reference_forward(model, self.frozen) as reference:
            return completion_logps(reference, batch, self.chunk)[0]

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss, and SUMS over the batch's pairs."""
        import torch
        import torch.nn.functional as F

        reference = self.reference_logps(model, batch)
        logps, tokens = completion_logps(model, batch, self.chunk)
        chosen_ratio, rejected_ratio = (logps - reference).chunk(2)
        delta = chosen_ratio - rejected_ratio
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(self.beta * delta)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - self.beta * delta)
        elif self.loss_type == "ipo":  # TRL's: log-ratios per completion token (its authors' normalised form)
            chosen_tokens, rejected_tokens = tokens.chunk(2)
            ipo_delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (ipo_delta - 1 / (2 * self.beta)) ** 2
        else:  # robust
            s = self.label_smoothing
            losses = (-(1 - s) * F.logsigmoid(self.beta * delta) + s * F.logsigmoid(-self.beta * delta)) / (1 - 2 * s)
        chosen_logps, rejected_logps = logps.chunk(2)
        return losses, sums(losses, self.beta * chosen_ratio, self.beta * rejected_ratio, chosen_logps, rejected_logps)
