"""What a strategy answers: how the processes share the model, and every question that follows."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import cached_property
from dataclasses import dataclass


@dataclass
class ParallelKeys:
    """The parallel.* keys: the mesh's dimensions beside data parallel, each declared by its strategy
    but context parallelism's, which every strategy reads (here)."""

    # processes that split each sequence (context parallelism: each holds a contiguous 1/cp_size of
    # every sequence, attention swaps it for the whole sequence on 1/cp_size of the heads by an
    # all-to-all); 1: none. They read the same samples: data-parallel ranks are processes / cp_size
    cp_size: int = 1


def running(accelerator, model=None) -> str:
    """The strategy this run really uses, read back from accelerate and the model: none, ddp,
    zero1, zero2, zero3 or fsdp2. FSDP2 is applied by trainloop, not by accelerate (which reports
    MULTI_CPU/MULTI_GPU or NO for it), so only the model can tell it: pass it."""
    from accelerate.utils import DistributedType

    from trainloop.model.tensors import is_fsdp2

    if model is not None and is_fsdp2(model):
        return "fsdp2"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.NO:
        return "none"
    return "ddp"  # MULTI_CPU, MULTI_GPU and the other multi-device types: DistributedDataParallel


def keep_output_dtype(model) -> None:
    """Drop the fp32 cast accelerate puts around a prepared model's forward under autocast (keeping
    the autocast): every loss and log-probability here upcasts the logits it reads itself, inside
    the compiled loss where there is one. Cast by accelerate, the logits left a compiled model as one
    more fp32 copy (with GPT-2's vocabulary, 3 GiB at 16 x 1,024 tokens) that the loss read and the
    backward kept; on one H200, trainloop compiled ran at 0.89x a raw loop with 1.31x its peak memory.
    `model`: a module accelerate prepared, unwrapped from DDP (the wrapper is on the inner module)."""
    from types import MethodType

    from accelerate.utils.operations import ConvertOutputsToFp32

    forward = model.forward
    function = getattr(forward, "__func__", forward)  # bound to the model, or a plain function
    cast = getattr(function, "__wrapped__", None)
    if isinstance(cast, ConvertOutputsToFp32):  # accelerate's native AMP: autocast, then this
        model.forward = cast.model_forward if function is forward else MethodType(cast.model_forward, model)


class Strategy:
    """How the model, its gradients and its optimizer state are spread over the processes: a row
    of trainloop.parallel.STRATEGIES, chosen from the config (deepspeed=, fsdp=).

    The data-parallel size and rank are what the rest of trainloop reads for the global sample
    order, the loss normalisation, tokens per step, the batch-size search and the checkpoint
    fingerprint: every process is a data-parallel rank, but for those that share one's samples:
    a strategy that splits layers over processes (tensor parallelism, a pipeline) answers fewer,
    and so does context parallelism (parallel.cp_size: `cp_size` consecutive ranks split each
    sequence, trainloop.parallel.context), which every strategy here reads. The build calls, in this order:
    `builds_on_meta` (before the model is built), `shard` (after compile, before the optimizer),
    `prepare` (the optimizer, and the model unless sharded here), then
    `prepare_frozen` for a frozen copy an objective keeps (DPO's reference), and `install` on each.
    """

    name = ""
    # its parallel.* keys beside the shared ones (ParallelKeys): a dataclass the config's schema composes into the
    # parallel section, as an objective's `keys` into objective's; None: none
    keys: type | None = None
    # parallel.KEY -> (does this config read it?, what makes it read): a key of its own it reads only in some settings
    read_when: dict = {}
    saves_async = False  # checkpoint.async_save: only DCP writes in the background
    autocast = True  # bf16/fp16 by autocast over fp32 parameters (the others compute on 16-bit copies)
    interleaved = False  # a step's forwards and backwards interleave (a pipeline schedule): no one forward to measure

    def __init__(self, cfg, accelerator):
        from trainloop.errors import ConfigError

        self.cfg, self.accelerator = cfg, accelerator
        self.cp_size = cfg.parallel.cp_size
        if self.world_size % self.cp_size:
            raise ConfigError(f"parallel.cp_size={self.cp_size} does not divide the {self.world_size} process(es): "
                              "launch a multiple of cp_size processes, or change parallel.cp_size")
        self._mesh = None
        self.cp = self.dp_group = None
        if self.cp_size > 1:
            from trainloop.parallel.context import ContextParallel

            self.cp = ContextParallel(self.mesh.group("cp"), self.cp_size, self.mesh.local_rank("cp"))
        if self.model_parallel(cfg) > 1:  # the ranks that hold one replica together count once (reduce_sum)
            self.dp_group = self.mesh.dp.get_group()

    @property
    def mesh(self):
        """The run's one device mesh (trainloop.parallel.mesh.Mesh), built by every rank at its first use: the
        strategy's construction where its degrees split a replica, FSDP2's shard otherwise. DeepSpeed's engine
        keeps its own groups."""
        if self._mesh is None:
            from trainloop.parallel.mesh import Mesh

            self._mesh = Mesh(self.cfg, self.device.type, self.world_size)
        return self._mesh

    # -- who is who ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @cached_property  # read every step: the config's lookups cost more than the step's small ops
    def dp_size(self) -> int:
        return self.accelerator.num_processes // self.model_parallel(self.cfg)

    @cached_property
    def dp_rank(self) -> int:
        """The mesh is row-major: the ranks that hold one replica together are consecutive."""
        return self.accelerator.process_index // self.model_parallel(self.cfg)

    @property
    def device(self):
        return self.accelerator.device

    def reduce_sum(self, tensor):
        """`tensor` summed over the data-parallel ranks (itself on one process): losses, units, tokens.
        The ranks that hold one replica together (a context-parallel or tensor-parallel group) hold the
        same (the whole batch's), and count once: over `dp_group`, where one is set."""
        if self.dp_group is None:
            return self.sum_over_all(tensor)
        import torch.distributed as dist

        summed = tensor.clone()
        if self.dp_size > 1:
            dist.all_reduce(summed, group=self.dp_group)
        return summed

    def reduce_computed(self, tensor):
        """reduce_sum of what the ranks that compute the loss accumulate from it (an objective's window of
        rewards and log-probabilities): on every rank here; a pipeline's last stage alone (Pipeline)."""
        return self.reduce_sum(tensor)

    def sequences_split(self, alone: bool = False):
        """The context the step's and the evaluation's forwards run in: split over the context-parallel
        group (trainloop.parallel.context), or whole (no group, or a process stepping `alone`)."""
        return nullcontext() if self.cp is None or alone else self.cp.active()

    def sum_over_all(self, tensor):
        """`tensor` summed over every process: what all of them must agree on (stop, skip)."""
        return self.accelerator.reduce(tensor, reduction="sum") if self.world_size > 1 else tensor

    # -- the build -------------------------------------------------------------------------------
    @staticmethod
    def accelerator_arguments(cfg, on_cuda: bool) -> tuple[dict, dict]:
        """Accelerator(...)'s arguments for this strategy, and its process group's (InitProcessGroupKwargs);
        called before the accelerator, and the strategy, exist."""
        return ({} if on_cuda else {"cpu": True}), {}  # no GPU: MULTI_CPU over gloo when launched as several

    @staticmethod
    def accelerator_built(cfg) -> None:
        """Called once the Accelerator is built, before the model is."""

    def builds_on_meta(self) -> bool:
        """Whether this process builds the model's shapes only, its weights coming from another."""
        return False

    def optimizer_offloaded(self) -> bool:
        """The optimizer state is kept and stepped in CPU memory by the strategy's own optimizer."""
        return False

    def shard(self, model):
        return model

    def prepare(self, model, optimizer):
        model, optimizer = self.accelerator.prepare(model, optimizer)
        # DDP's (or DeepSpeed's engine's) .module: accelerate's unwrap_model would import DeepSpeed, 58 MB
        # of a CPU process's memory that the planner's measured peak then counted (tests/test_suggest.py)
        keep_output_dtype(getattr(model, "module", model))
        return model, optimizer

    def prepare_frozen(self, model):
        """A frozen copy of the model as built (an objective's reference), placed and sharded like
        the policy and put in eval mode: it computes as the policy does at step 0, without gradients.
        Here: on the device, its forward under the same autocast as the policy's, not wrapped in DDP,
        and not among the models accelerate saves and loads with the checkpoint."""
        model = self.accelerator.prepare_model(model, evaluation_mode=True)
        self.accelerator._models.remove(model)  # noqa: SLF001 - prepare_model registers it for save_state
        keep_output_dtype(model)
        return model.eval()

    def install(self, model):
        """`model`, as prepare or prepare_frozen placed it, with what its forwards read from the layout: context
        parallelism's group, which splits its sequences inside sequences_split (trainloop.parallel.context.of)."""
        return model if self.cp is None else self.cp.install(model)

    def holds_frozen(self, frozen) -> str:
        """How the ranks hold a frozen copy prepare_frozen placed, read back from it (FSDP2's DTensors, DeepSpeed's
        engine), for the start-up line."""
        from trainloop.model.tensors import is_fsdp2

        if is_fsdp2(frozen):
            return "sharded by FSDP2 like the policy"
        if hasattr(frozen, "zero_optimization_stage"):
            stage = frozen.zero_optimization_stage()
            return f"partitioned by DeepSpeed ZeRO-{stage} like the policy" if stage == 3 else \
                "whole on each rank (a DeepSpeed engine without ZeRO: the policy's stage partitions no parameters)"
        return "whole on each rank"

    # -- each step -------------------------------------------------------------------------------
    def forward_backward(self, objective, model, group: list[dict], units, forward_context, alone: bool = False):
        """The forwards and backwards of a step's micro-batches (`group`), one after another, the
        gradients reduced over the ranks on the last; returns this rank's share of the step's loss.

        accelerate divides what backward gets by the accumulation steps and DDP averages over the
        ranks: scaled by both, the gradient is the sum of the units' loss gradients / the step's
        `units`. A context-parallel group's ranks each hold their slices' share of its batch's
        gradient, which the average must sum: it is over dp_size x cp_size ranks.
        forward_context: the context each forward runs in (trainloop.step.train_step)."""
        scale = self.accelerator.gradient_accumulation_steps * (1 if alone else self.dp_size * self.cp_size)
        factor, step_loss = scale / units, None
        for i, batch in enumerate(group):
            # split over a context-parallel group through the backward too: a checkpointed block recomputes there
            with self.micro_step(model, last=i == len(group) - 1), self.sequences_split(alone):
                with forward_context():
                    out = objective.batch_loss(model, batch)
                loss = out.summed * factor
                # divided by `scale` too: the step adds the mean penalty of its forwards
                if out.penalty is not None:
                    loss = loss + out.penalty
                self.backward(loss)
            share = out.summed.detach() / units  # this rank's share of the step's loss
            step_loss = share if step_loss is None else step_loss + share
        return step_loss

    def backward(self, loss) -> None:
        """accelerate's backward: divided by the accumulation steps, scaled by fp16's grad scaler. A step of one
        micro-batch without a scaler skips its division by 1 (an op and its backward, as much as a tiny layer's)."""
        accelerator = self.accelerator
        if accelerator.gradient_accumulation_steps == 1 and accelerator.scaler is None:
            loss.backward()
        else:
            accelerator.backward(loss)

    def eval_sums(self, objective, model, batch: dict):
        """What an evaluation forward of `batch` adds up (the objective's eval_sums), on every rank."""
        with self.sequences_split():
            return objective.eval_sums(model, batch)

    def computed(self, objective, model, batch: dict, compute, inputs: dict | None = None):
        """compute(model): a tensor from a forward of `model` (the policy, or a frozen copy prepare_frozen placed)
        on `inputs` (the objective's forward_inputs(batch) if None), without gradients, on every rank. Here the
        forward is compute's own; the pipeline runs it across the model's stages and hands compute the last one's
        output."""
        return compute(model)

    @contextmanager
    def generator(self, model):
        """The model to call `generate` on for the length of the block, its forwards run as this layout runs
        them: here the unwrapped model, attending by sdpa's own masks (trainloop.model.attention.generating)."""
        from trainloop.model.attention import generating

        module = self.accelerator.unwrap_model(model)
        with generating(module):
            yield module

    def micro_step(self, model, last: bool):
        """accelerate's `accumulate`, with the step's last micro-batch named by the step: the loop reads
        a step's batches before running them, so accelerate's own end-of-epoch test would fire early.
        Gradients are reduced over the ranks only on the last (the context `gradient_sync` returns)."""
        self.accelerator.sync_gradients = last
        return self.gradient_sync(model, enabled=last)

    def clip_grad_norm(self, model, max_norm: float):
        """Clip the gradients to `max_norm` (inf: only measure) and return their global L2 norm. Here each rank
        holds whole gradients, reduced already: torch's clip, which accelerate's calls after unscaling fp16's."""
        import torch

        if self.accelerator.scaler is not None:
            return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    @contextmanager
    def gradient_sync(self, model, enabled: bool):
        """Reduce this micro-batch's gradients over the ranks, or only accumulate them locally
        (every micro-batch of a step but the last)."""
        if enabled:
            yield
        else:
            with self.accelerator.no_sync(model):
                yield

    # -- state -----------------------------------------------------------------------------------
    def save_state(self, directory, model, adapter_only: bool, record) -> None:
        """Every rank, together: the model, optimizer and each rank's state into `directory`. A layout that
        hashes what it writes as it writes it (DCP) calls `record(directory, files, who)`
        (trainloop.checkpoint.integrity.record); the checkpointer hashes the files named by rank after."""
        raise NotImplementedError

    def load_state(self, path, model, adapter_only: bool) -> None:
        raise NotImplementedError

    def full_state_dict(self, model) -> dict:
        """The full weights, on the main process ({} elsewhere). Every rank must call it."""
        return self.accelerator.get_state_dict(model)

    def count_parameters(self, model) -> tuple[int, int]:
        """(the model's parameters, those that train), whole, however the processes hold them."""
        from trainloop.model.tensors import full_numel

        return (sum(full_numel(p) for p in model.parameters()),
                sum(full_numel(p) for p in model.parameters() if p.requires_grad))

    def whole_model(self, model):
        """The model the export writes the gathered state dict through (main process): its modules
        and configs name what the files hold. Here the unwrapped model, which holds every module."""
        return self.accelerator.unwrap_model(model)

    def describe(self, model) -> str:
        """What really runs, read back from accelerate (and the engine or the model), for the log."""
        raise NotImplementedError

    def where(self) -> str:
        acc = self.accelerator
        return f"{acc.num_processes} process(es){self.splits()}, {acc.device}, backend {acc.state.backend}"

    def splits(self) -> str:
        """The log line's word on context parallelism, if any."""
        return f", context parallel: {self.cp_size} processes split each sequence" if self.cp is not None else ""

    # -- the planner's, --suggest's and the doctor's terms ---------------------------------------------
    # this strategy's keys at the values that turn it off: a layout --suggest weighs sets every row's,
    # so neither the user's overrides nor a preset can leave a stale one behind
    off: dict = {}

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        """The layouts `plan --suggest` weighs with this strategy: a name -> the overrides that choose it."""
        return {}

    @staticmethod
    def model_parallel(cfg) -> int:
        """Processes that hold one data-parallel replica together (tensor-parallel ranks, pipeline
        stages, a context-parallel group): the data-parallel size is the process count over this."""
        return cfg.parallel.cp_size

    @staticmethod
    def min_accumulation(cfg) -> int:
        """The fewest micro-batches a step may have (a pipeline's: one per stage)."""
        return 1

    @staticmethod
    def bubble(cfg) -> float:
        """The idle time of a pipeline's step, as a fraction of its compute (0: no pipeline)."""
        return 0.0

    @staticmethod
    def tensor_parallel(cfg) -> tuple[int, bool]:
        """(how many processes split each layer, whether the sequence is split too) for the planner."""
        return 1, False

    @staticmethod
    def activations_held(cfg, shape) -> tuple[float, int]:
        """For the planner: (the blocks' activations the planned process keeps at its peak, in one
        micro-batch's blocks; the micro-batches whose output layer and logits it keeps). Here every
        block of one micro-batch, and its logits."""
        return shape.num_layers, 1

    @staticmethod
    def settings(cfg) -> dict:
        """This strategy's own keys as the config sets them (the doctor reports and checks them)."""
        return {}

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """The planner's model-state lines for one process (trainloop.tools.plan): parameters,
        gradients, optimizer states and this strategy's own buffers, as trainloop.parallel.memory
        Lines appended to `plan`. `shape`: trainloop.tools.shape.ModelShape; `dev`: gpu or cpu."""
        raise NotImplementedError

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """The planner's communication for one process per optimizer step: trainloop.parallel.memory
        Transfers appended to `plan.traffic` (the bytes it sends in each collective, and over PCIe
        to and from an offloaded copy), counted as the ZeRO paper counts them (ring collectives)."""
        raise NotImplementedError

    @staticmethod
    def keeps_world_size(cfg) -> str | None:
        """Why this strategy's checkpoints resume only on the world size that saved them (each rank's
        files hold its own partition), for the refusal's message; None: they load at any world size."""
        return None

    @staticmethod
    def problems(cfg) -> list[str]:
        """Combinations this strategy cannot run (each with what to choose instead); [] when it is
        not chosen, unless the keys it alone reads are set."""
        return []

    @staticmethod
    def shards_weights(cfg) -> bool:
        """Each process holds a shard of every weight and gathers it for its forwards: a frozen copy placed like
        the model (a teacher, a reference) is held so too."""
        return False

    @staticmethod
    def forwards_together(cfg) -> str | None:
        """This layout, named for a message, if every rank's forward runs with the others' (it gathers sharded
        weights, or passes activations between stages); None: each rank may run forwards on its own schedule
        (a rank's generation may take as many as its own rows need)."""
        return None

    @staticmethod
    def chooses(cfg) -> bool:
        """Whether the config chooses this row: of the rows of STRATEGIES that say so, the last is the run's (a row
        refines the ones above it: FSDP2 x TP is FSDP2 with parallel.tp_size > 1)."""
        return False
