"""The config's sections that no row of a table declares: a dataclass each, with each key's type,
default and meaning, and the keys every data format reads (the data section's own).

The keys of one objective, data format or strategy are declared beside its code, and
trainloop/config/schema.py composes them with these into the config Hydra fills. Only plain values
live here, and this module imports nothing from trainloop: every module may read its types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    name: str = "tiny"  # tiny: built from the shape below; hf: loaded from name_or_path
    arch: str = "llama"  # tiny only: llama, gpt2, mixtral (a Llama whose MLPs are routed experts) or llava (a vision tower before a Llama)
    name_or_path: Optional[str] = None  # hf only: a local directory, or a hub id when online
    num_layers: int = 4  # tiny only: transformer blocks
    hidden_size: int = 256  # tiny only: width of the residual stream
    num_heads: int = 4  # tiny only: attention heads; must divide hidden_size
    num_kv_heads: Optional[int] = None  # tiny llama/mixtral only: key/value heads (grouped-query attention), dividing num_heads; None: num_heads
    intermediate_size: Optional[int] = None  # None: 4 x hidden_size
    max_position_embeddings: int = 1024  # tiny only: the longest sequence the model accepts
    vocab_multiple: int = 64  # pad the embedding to a multiple of this (tensor-core friendly)
    tie_embeddings: bool = True  # tiny only: the output head shares the input embedding's weight (false: its own, as Llama 3 8B)
    dropout: float = 0.0  # tiny only: in [0, 1); 0 lets runs on 1 and N processes agree
    num_experts: int = 8  # arch=mixtral only: expert MLPs per block
    experts_per_token: int = 2  # arch=mixtral only: experts the router sends each token to
    router_aux_loss_coef: float = 0.001  # arch=mixtral only: weight of the router's load-balancing loss
    image_size: int = 32  # arch=llava only: the side, in pixels, each image is resized and cropped to
    patch_size: int = 8  # arch=llava only: the vision tower's patches; (image_size / patch_size)^2 image tokens an image
    vision_layers: int = 2  # arch=llava only: the vision tower's transformer blocks
    vision_hidden_size: int = 64  # arch=llava only: the vision tower's width (heads of 32)
    # a vision-language model's parts trained not at all: vision (the vision tower), projector (what maps its
    # features into the language model's embeddings); [] trains every part
    freeze: list[str] = field(default_factory=list)
    attn_implementation: str = "sdpa"  # sdpa, eager, flash_attention_2
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    quantization: str = "none"  # hf with adapter=lora only: none, 4bit (NF4, QLoRA), 8bit; frozen base weights


@dataclass
class AdapterConfig:
    name: str = "none"  # none: train every weight; lora: train low-rank adapters, the base frozen (peft)
    r: int = 8  # lora only: rank of each adapter's two matrices
    alpha: float = 16.0  # lora only: the adapter's output is scaled by alpha / r
    dropout: float = 0.0  # lora only: dropout on the adapter's input, in [0, 1)
    target_modules: Optional[list[str]] = None  # lora only: module names to adapt; None: every linear layer but the output head
    modules_to_save: Optional[list[str]] = None  # lora only: modules trained in full and saved with the adapter


@dataclass
class SourceConfig:
    """One source of a mixture (data.sources): read as the data option reads data.path."""

    path: str = MISSING  # what data.path would be for this source alone
    weight: float = 1.0  # its share of the training blocks: weight / the sum of the weights
    name: Optional[str] = None  # its key in metrics.jsonl's tokens_per_source; None: its file or folder stem


@dataclass
class DataConfig:
    """The data keys every format reads; each format declares its own beside its code (trainloop/data/formats)."""

    name: str = "pydoc"  # pydoc: Python's bundled documentation; files, chat, prompt_completion, preference, prompts, prepared: data.path
    path: Optional[str] = None  # a file, a directory or a glob of text/json/jsonl/csv/parquet; prepared: the shards' folder
    # a mixture instead of data.path: [{path: P, weight: W, name: N}, ...]; each path read as data.path
    # would be; blocks interleaved in proportion W / sum of weights (default 1); N (default: P's stem) keys
    # tokens_per_source in metrics.jsonl (trainloop/data/mixture.py)
    sources: Optional[list[SourceConfig]] = None
    train_on: str = "all"  # tokens with a loss: all; assistant (chat's default); completion (prompt_completion's)
    # documents: rows packed into seq_len blocks, attention and position ids kept inside each row;
    # stream: rows end to end, cut every seq_len tokens; none: one padded row per block
    packing: str = "documents"
    # a row longer than seq_len (packing documents or none): truncate (chat, prompt_completion),
    # drop, or split into seq_len pieces packed as rows of their own (pydoc, files: nothing lost)
    overlong: str = "split"
    tokenizer: Optional[str] = None  # a local tokenizer directory; None: model's own or bytes
    seq_len: int = 128  # tokens per training block; rows are packed into blocks as data.packing says
    batch_size: int = 8  # per device, per micro-step
    validation_fraction: float = 0.05  # share of the documents (whole ones, drawn from trainer.seed) held out for evaluation
    num_proc: Optional[int] = None  # processes for datasets.map
    num_workers: int = 0  # DataLoader worker processes; 0: load in the training process
    pin_memory: bool = True  # only takes effect when a CUDA device is used
    persistent_workers: bool = False  # keep the workers between epochs (needs num_workers > 0)
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead (needs num_workers > 0)
    multiprocessing_context: str = "forkserver"  # how workers start: forkserver, spawn or fork


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw, adafactor, adamw8bit, paged_adamw8bit, sgd, muon
    # peak learning rate, reached after scheduler.warmup_steps; None: for a pretrained model (model=hf) the
    # objective's default, TRL's for its trainer (its row's pretrained_lr: e.g. 1e-6 for dpo, 1e-4 for reward,
    # 2e-5 for causal_lm), for a model trained from scratch (model=tiny) the optimizer's (1e-3; sgd 1e-1)
    lr: Optional[float] = None
    weight_decay: float = 0.1  # on matrices and embeddings; never on biases and norm weights
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam's moment decay rates
    eps: float = 1e-8  # Adam's denominator term
    momentum: float = 0.9  # sgd and muon (its hidden matrices' momentum) only
    impl: str = "auto"  # adamw (and muon's AdamW part) only: auto (= fused), fused, foreach, for_loop
    # data=vision_chat only: the peak learning rate of a vision-language model's projector (LLaVA's mm_projector_lr),
    # scheduled as the rest; None: optimizer.lr
    projector_lr: Optional[float] = None


@dataclass
class SchedulerConfig:
    name: str = "cosine"  # cosine, linear, constant
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to optimizer.lr


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32, bf16, fp16, fp8
    tf32: bool = False  # TF32 matmuls and convolutions on Ampere and newer GPUs
    fp8_emulate: bool = False  # fp8 only: emulate the float8 matmuls on a GPU (needed below compute capability 8.9; a CPU always emulates)
    fp8_skip_small: bool = False  # fp8 only: leave in bf16 the layers torchao's thresholds call too small to gain


@dataclass
class TrainerConfig:
    max_steps: int = 500  # optimizer steps
    seed: int = 1234  # model init, data order and dropout
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_grad_norm: Optional[float] = 1.0  # None: no clipping
    log_every: int = 10  # optimizer steps between train lines in metrics.jsonl
    eval_every: int = 100  # optimizer steps between evaluations; the last step always evaluates
    eval_batches: Optional[int] = None  # global batches evaluated (data.batch_size x accumulation x processes items each); None: all
    on_nonfinite: str = "stop"  # skip or stop, when the loss or gradient norm is NaN/Inf
    stop_at_step: Optional[int] = None  # save and stop after this step; the schedule still runs to max_steps
    auto_batch_size: bool = False  # find the largest per-device batch that fits; keep the effective batch
    auto_batch_size_budget_mb: Optional[float] = None  # memory a step may add to the loaded model; None: all free
    collective_timeout_s: float = 1800  # how long a collective (all-reduce, barrier) may wait for a rank before failing
    # the output layer and cross-entropy N tokens at a time, never the full logits (less memory at a
    # large vocabulary); 0: the full logits. Objectives that score tokens read it (trainloop/objectives/chunked_loss.py)
    loss_chunk_tokens: int = 0
    activation_offload: bool = False  # CUDA: what the forward saves for the backward kept in pinned host memory


@dataclass
class CheckpointConfig:
    every_steps: Optional[int] = None  # None: only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are removed after a save
    resume: Optional[str] = "auto"  # auto: the latest in the run dir, if any; a checkpoint dir; None: never
    save_final_model: bool = True  # write RUN_DIR/final in Hugging Face format
    async_save: bool = False  # fsdp=full_shard only: write checkpoints in the background while training goes on


@dataclass
class LoggingConfig:
    # a tqdm bar on the main process (and the libraries' bars); None: only where stderr is a terminal, never in a
    # file (nohup, SLURM); true or false forces it. train.log has every log step, eval and sample line either way
    progress_bar: Optional[bool] = None
    telemetry_every: Optional[int] = None  # None: no telemetry lines in metrics.jsonl
    profile_steps: Optional[list[int]] = None  # [START, END]: torch.profiler trace of these optimizer steps (1-based, inclusive) in RUN_DIR/profile/
    profile_ranks: str = "main"  # main: profile the main process only; all: every rank
    peak_tflops: Optional[float] = None  # the device's peak for mfu; None: the GPU table (trainloop/model/flops.py), none on CPU
    # accelerate's trackers that get every metrics.jsonl line (tensorboard, mlflow, wandb, ...); []: none
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])


@dataclass
class HarnessConfig:
    """lm-evaluation-harness (`pip install 'trainloop[eval]'`) scoring the live model (trainloop/observe/harness.py)."""

    tasks: list[str] = field(default_factory=list)  # the harness's tasks (or groups) to score the model on, e.g. [pydoc_order, pydoc_words] (shipped in examples/harness); []: none
    include_path: Optional[str] = None  # a folder of your own task YAMLs, searched with the shipped ones before the harness's registry
    every: Optional[int] = None  # optimizer steps between scorings; the last step always scores; None: the last step only
    limit: Optional[float] = None  # documents per task: N, or a fraction of them below 1; None: all
    num_fewshot: Optional[int] = None  # examples in each prompt; None: each task's own
    batch_size: int = 8  # requests per forward


@dataclass
class EvalConfig:
    prompts: list[str] = field(default_factory=list)  # at every evaluation, greedy completions of these into metrics.jsonl
    max_new_tokens: int = 32  # tokens generated per prompt
    # data=vision_chat only: an image for each prompt (a path), asked as a user turn of the image and the prompt,
    # rendered by the run's processor with its chat template; [] asks the prompts as they are
    images: list[str] = field(default_factory=list)
    harness: HarnessConfig = field(default_factory=HarnessConfig)


@dataclass
class CompileConfig:
    backend: str = "none"  # none, inductor, aot_eager, eager, cudagraphs
    mode: str = "default"  # default, reduce-overhead, max-autotune
    fullgraph: bool = False  # fail at a graph break instead of splitting the graph there
    dynamic: Optional[bool] = None  # None: torch decides; true/false: compile for dynamic/static shapes
    regional: bool = False  # compile each transformer block instead of the whole model
    # the optimizer's step compiled too: null where it pays (torch's optimizer, not already one fused kernel, on
    # whole parameters: one generated loop instead of a dozen ops a parameter); true; false (the model only)
    optimizer: Optional[bool] = None
