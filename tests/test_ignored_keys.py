"""No key is silently ignored: a key given on the command line either changes what the chosen
option builds, or the run is refused before anything is built, naming the option that reads it.

The test walks every option of every group and every key of that group. For each key it sets a
probe value, builds what the option builds (model, datasets and loaders, optimizer, schedule,
DeepSpeed config, compiled modules) with the real build functions, and compares with the build
without it: "read" means the build changed. A key the run accepts must be read; a key that
check_command_line refuses must not be (unless validate refuses the combination anyway).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import NEEDS, OPTIONS, compose, reset_accelerate, script, started, warm
from trainloop.config import schema
from trainloop.config.compose import ConfigError, check_command_line, validate

# Keys every option reads, whose effect a build on this CPU machine cannot show.
NOT_PROBED = {
    "data.num_proc": "processes of datasets.map: the same blocks, only faster",
    "data.pin_memory": "takes effect only on a CUDA device; configs stay portable to CPU",
    "precision.tf32": "takes effect only on an Ampere or newer GPU; warns elsewhere",
    "precision.fp8_emulate": "takes effect only on a GPU (a CPU always emulates float8); warns elsewhere",
    "objective.tools": "a random model calls no tool; tests/test_grpo_tools.py: the schemas rendered into the "
                       "prompts, the calls answered",
    "objective.environment": "a random model calls no tool; tests/test_grpo_tools.py: an instance per rollout, reset "
                             "with its row, its methods the tools, its reward a column",
    "objective.max_tool_calls": "a random model calls no tool; tests/test_grpo_tools.py: the rounds it allows",
    "objective.tool_timeout_s": "a random model calls no tool; tests/test_grpo_tools.py: a hung tool answered at it",
    "objective.precompute_reference": "when dpo's reference is computed, not the loss (tests/test_dpo.py: the same "
                                      "losses within 1e-6, read back on a resume; test_plan.py: the copy freed)",
}
SELECTORS = {"model.name", "data.name", "optimizer.name", "scheduler.name", "precision.name",
             "deepspeed.stage", "compile.backend", "adapter.name", "fsdp.name", "objective.name"}  # choose the option itself


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Two local models, two jsonl corpora of each data format, a second tokenizer, a DeepSpeed JSON,
    a file of reward functions and a reward model."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    from trainloop.config.compose import compose_config
    from trainloop.data.shards import prepare

    root = tmp_path_factory.mktemp("probes")
    keys = sorted(topics)[:30]
    for name, part in (("corpus_a", keys[:15]), ("corpus_b", keys[15:])):
        with (root / f"{name}.jsonl").open("w") as f:
            for key in part:
                f.write(json.dumps({"text": topics[key], "other": topics[key][::-1]}) + "\n")
    for name, hidden in (("model_a", 64), ("model_b", 96)):  # vocab 200 < the 257 byte tokens
        config = LlamaConfig(vocab_size=200, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    from transformers import AutoModelForSequenceClassification

    from trainloop.data.tokenizer import byte_level_tokenizer

    scorer = byte_level_tokenizer()  # a reward model (objective.reward_models): a sequence classifier, one score
    scorer.pad_token = scorer.eos_token
    AutoModelForSequenceClassification.from_config(LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_labels=1, pad_token_id=scorer.pad_token_id)).save_pretrained(root / "scorer")
    scorer.save_pretrained(root / "scorer")
    AutoModelForCausalLM.from_config(LlamaConfig(  # a second teacher (objective.teacher): the tiny models' vocabulary
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2)).save_pretrained(root / "teacher_b")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([topics[k] for k in keys], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", unk_token="<unk>").save_pretrained(
        root / "bpe")
    (root / "ds.json").write_text(json.dumps({"zero_optimization": {"round_robin_gradients": True}}))
    # Fine-tuning rows: short prompts, replies longer than the smoke preset's 64-token blocks, so
    # data.overlong shows; a second column of each kind for the field keys to point at.
    for name, part in (("chat_a", keys[:15]), ("chat_b", keys[15:])):
        with (root / f"{name}.jsonl").open("w") as f:
            for key in part:
                reply = topics[key][:150]
                f.write(json.dumps({"messages": [{"role": "user", "content": key[:4]}, {"role": "assistant", "content": reply}],
                                    "other": [{"role": "user", "content": reply[:4]},
                                              {"role": "assistant", "content": key}],
                                    "functions": [{"name": "f"}] if key == part[0] else None}) + "\n")
    for name, part in (("pairs_a", keys[:15]), ("pairs_b", keys[15:])):
        with (root / f"{name}.jsonl").open("w") as f:
            for key in part:
                f.write(json.dumps({"prompt": key[:4], "completion": topics[key][:150],
                                    "question": topics[key][:30], "answer": key}) + "\n")
    for name, part in (("preference_a", keys[:15]), ("preference_b", keys[15:])):  # conversations: the template shows
        with (root / f"{name}.jsonl").open("w") as f:
            for key in part:
                turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
                f.write(json.dumps({"prompt": turn("user", key[:4]), "chosen": turn("assistant", topics[key][:20]),
                                    "rejected": turn("assistant", key), "question": turn("user", topics[key][:9]),
                                    "better": turn("assistant", key[::-1]),
                                    "worse": turn("assistant", topics[key][-20:])}) + "\n")
    for name, part in (("unpaired_a", keys[:15]), ("unpaired_b", keys[15:])):  # conversations: the template shows
        with (root / f"{name}.jsonl").open("w") as f:
            for i, key in enumerate(part):
                turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
                f.write(json.dumps({"prompt": turn("user", key[:4]), "completion": turn("assistant", topics[key][:20]),
                                    "label": i % 2 == 0, "question": turn("user", topics[key][:9]),
                                    "answer": turn("assistant", key[::-1]), "verdict": i % 3 == 0}) + "\n")
    for name, part in (("prompts_a", keys[:15]), ("prompts_b", keys[15:])):  # conversations: the template shows
        with (root / f"{name}.jsonl").open("w") as f:
            for key in part:
                f.write(json.dumps({"prompt": [{"role": "user", "content": key[:3]}],
                                    "question": [{"role": "user", "content": topics[key][:9]}],
                                    "answer": key}) + "\n")
    # two reward functions that score a random model's completions unlike each other (objective=grpo)
    (root / "rewards.py").write_text(
        "def letters(prompts, completions, **columns):\n"
        "    return [sum(ch.isalpha() for ch in c[-1]['content']) / max(len(c[-1]['content']), 1) for c in completions]\n"
        "\n\n"
        "def printable(prompts, completions, **columns):\n"
        "    return [sum(ch.isprintable() for ch in c[-1]['content']) / max(len(c[-1]['content']), 1) for c in completions]\n"
        "\n\n"
        "def place(prompts, completions, **columns):\n"  # what the sampled text says does not matter to these two
        "    return [float(i) for i in range(len(completions))]\n"
        "\n\n"
        "def place_squared(prompts, completions, **columns):\n"
        "    return [float(i * i) for i in range(len(completions))]\n")
    (root / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                     "{% if add_generation_prompt %}assistant: {% endif %}")
    for name in ("corpus_a", "corpus_b"):  # the same corpora, prepared (data=prepared)
        prepare(compose_config(["data=files", f"data.path={root / name}.jsonl"]), str(root / f"prepared_{name[-1]}"),
                progress=False)
    # conversations with images (data=vision_chat): a second conversation and image column for the field keys, one
    # reply longer than the base's 96-token rows (data.overlong shows), a template with the assistant marked
    squares = script("vision_squares")
    for name, seed in (("vision_a", 0), ("vision_b", 1)):
        drawn = squares.squares(12, seed)
        for n, (_, image) in enumerate(drawn):
            image.save(root / f"{name}_{n}.png")
        with (root / f"{name}.jsonl").open("w") as f:
            for n, (colour, _) in enumerate(drawn):
                said = colour if n else f"{colour}, " + "surely " * 10
                f.write(json.dumps({"messages": squares.conversation(said), "images": [f"{name}_{n}.png"],
                                    "other": squares.conversation(colour.upper()),
                                    "pictures": [f"{name}_{(n + 1) % len(drawn)}.png"]}) + "\n")
    (root / "vision.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{% if m['role'] == 'assistant' %}"
        "{% generation %}{{ p['text'] }}{% endgeneration %}{% else %}{{ p['text'] }}{% endif %}{% endif %}{% endfor %}"
        "{% endif %}\n{% endfor %}")
    return {"prepared_a": root / "prepared_a", "prepared_b": root / "prepared_b",
            "vision_a": root / "vision_a.jsonl", "vision_b": root / "vision_b.jsonl", "vision.jinja": root / "vision.jinja",
            "corpus_a": root / "corpus_a.jsonl", "corpus_b": root / "corpus_b.jsonl", "model_a": root / "model_a",
            "model_b": root / "model_b", "teacher_b": root / "teacher_b", "bpe": root / "bpe",
            "ds.json": root / "ds.json",
            "chat_a": root / "chat_a.jsonl", "chat_b": root / "chat_b.jsonl", "pairs_a": root / "pairs_a.jsonl",
            "pairs_b": root / "pairs_b.jsonl", "chat.jinja": root / "chat.jinja",
            "preference_a": root / "preference_a.jsonl", "preference_b": root / "preference_b.jsonl",
            "prompts_a": root / "prompts_a.jsonl", "prompts_b": root / "prompts_b.jsonl",
            "rewards.py": root / "rewards.py", "scorer": root / "scorer", "unpaired_a": root / "unpaired_a.jsonl",
            "unpaired_b": root / "unpaired_b.jsonl"}


# The corpus each data option reads (a, the base) and its probe for data.path (b).
CORPUS = {"files": "corpus", "chat": "chat", "prompt_completion": "pairs", "prepared": "prepared",
          "preference": "preference", "prompts": "prompts", "unpaired": "unpaired", "vision_chat": "vision"}
PAIRED = {"preference": ["objective=dpo", "adapter=lora"],  # what trains on the option's pairs, rows or prompts
          "unpaired": ["objective=kto", "adapter=lora"],
          "prompts": ["objective=grpo", "objective.rewards=[trainloop.objectives.rewards:exact_answer]"],
          "vision_chat": ["model.arch=llava", "data.seq_len=96"]}


def generating(files) -> list[str]:
    """What objective=grpo's probe generates from: real prompts, two reward functions whose weights show
    in the advantages whatever the model samples (a completion's place in the call, and its square: in a
    group of 3, no weighting of one is the other's shape; with 2, a group's normalised advantages are
    +-1 and show only the sign of the weighted difference), LoRA (objective.beta > 0 needs it) and a
    rollout small enough for a few seconds."""
    rewards = files["rewards.py"]
    return [f"data.path={files['prompts_a']}", f"objective.rewards=[{rewards}:place,{rewards}:place_squared]",
            "adapter=lora", "objective.num_generations=3", "objective.max_new_tokens=4"]


def probes(files, data_option: str = "files", objective: str = "dpo") -> dict[str, object]:
    """A value for each key of each group, unlike its default (for data keys: the data option's; for
    objective keys that several objectives read: one the objective accepts)."""
    fine_tuning = data_option in ("chat", "prompt_completion", "preference", "unpaired")
    vision = data_option == "vision_chat"  # its rows: one image's 16 tokens and a conversation, in 96 tokens
    return {
        "model.name_or_path": files["model_b"], "model.arch": "gpt2", "model.num_layers": 3,
        "model.hidden_size": 96, "model.num_heads": 4, "model.intermediate_size": 100,
        "model.num_kv_heads": 1, "model.tie_embeddings": False,
        "model.max_position_embeddings": 512, "model.vocab_multiple": 128, "model.dropout": 0.1,
        "model.attn_implementation": "eager", "model.gradient_checkpointing": True, "model.quantization": "4bit",
        "model.num_experts": 4, "model.experts_per_token": 1, "model.router_aux_loss_coef": 0.01,
        "model.image_size": 64, "model.patch_size": 16, "model.vision_layers": 1, "model.vision_hidden_size": 96,
        "model.freeze": ["vision"],
        "adapter.r": 4, "adapter.alpha": 32.0, "adapter.dropout": 0.1, "adapter.target_modules": ["q_proj", "v_proj"],
        "adapter.modules_to_save": ["norm"],
        "data.path": files[f"{CORPUS.get(data_option, 'corpus')}_b"], "data.text_field": "other",
        "data.sources": f"[{{path: {files[CORPUS.get(data_option, 'corpus') + '_b']}, weight: 1}}]",
        "data.messages_field": "other", "data.tools_field": "functions", "data.images_field": "pictures",
        "data.chat_template": files["vision.jinja" if vision else "chat.jinja"],
        "data.prompt_field": "question", "data.completion_field": "answer",
        "data.chosen_field": "better", "data.rejected_field": "worse", "data.label_field": "verdict",
        "data.train_on": "all" if fine_tuning or vision else "assistant", "data.packing": "stream",
        "data.overlong": "drop" if vision else "split" if fine_tuning else "truncate", "data.tokenizer": files["bpe"],
        "data.seq_len": 90 if vision else 32, "data.batch_size": 2, "data.validation_fraction": 0.2, "data.num_workers": 1,
        "data.persistent_workers": True, "data.prefetch_factor": 4, "data.multiprocessing_context": "spawn",
        "optimizer.lr": 0.5, "optimizer.weight_decay": 0.3, "optimizer.betas": [0.8, 0.9],
        "optimizer.eps": 1e-6, "optimizer.momentum": 0.5, "optimizer.impl": "for_loop",
        "optimizer.projector_lr": 0.01,
        "scheduler.warmup_steps": 5,
        "deepspeed.offload_optimizer": "cpu", "deepspeed.offload_param": "cpu", "deepspeed.nvme_path": "/tmp",
        "deepspeed.overlap_comm": False, "deepspeed.contiguous_gradients": False,
        "deepspeed.reduce_bucket_size": 1000, "deepspeed.allgather_bucket_size": 1000,
        "deepspeed.stage3_prefetch_bucket_size": 1000, "deepspeed.stage3_param_persistence_threshold": 10,
        "deepspeed.gather_16bit_weights_on_model_save": False, "deepspeed.zero3_init": True,
        "deepspeed.config_file": files["ds.json"],
        "compile.mode": "max-autotune", "compile.fullgraph": True, "compile.dynamic": True,
        "compile.regional": True, "compile.optimizer": True,
        "fsdp.reshard_after_forward": False, "fsdp.offload": "cpu", "fsdp.sync_each_batch": False,
        "precision.fp8_skip_small": True,
        "objective.beta": 0.3, "objective.loss_type": "grpo" if objective == "grpo" else "ipo",
        "objective.label_smoothing": 0.1, "objective.gamma": 0.3,
        "objective.rewards": [f"{files['rewards.py']}:printable"], "objective.reward_weights": [1.0, 3.0],
        "objective.num_generations": 4, "objective.temperature": 0.7, "objective.top_p": 0.5,
        "objective.max_new_tokens": 3, "objective.scale_rewards": "batch", "objective.epsilon": 0.05,
        "objective.epsilon_high": 0.5, "objective.num_iterations": 2, "objective.importance_sampling_level": "sequence",
        "objective.top_entropy_quantile": 0.5, "objective.sapo_temperature_pos": 0.5,
        "objective.sapo_temperature_neg": 2.0, "objective.vespo_k_pos": 1.0, "objective.vespo_lambda_pos": 1.5,
        "objective.vespo_k_neg": 2.5, "objective.vespo_lambda_neg": 0.5, "objective.generation": "continuous",
        "objective.center_rewards_coefficient": 0.5, "objective.reward_models": [str(files["scorer"])],
        "objective.desirable_weight": 1.5, "objective.undesirable_weight": 0.5,
        "objective.teacher": str(files["teacher_b"]), "objective.on_policy_fraction": 0.5,
    }


def group_keys(group: str) -> set[str]:
    node = {f.name: f for f in dataclasses.fields(schema.TrainConfig)}[group]
    return {f"{group}.{f.name}" for f in dataclasses.fields(node.type if isinstance(node.type, type)
                                                             else getattr(schema, node.type))}


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest() + str(tuple(tensor.shape))


# What build_dataloaders reads of data.*; and the walk's base datasets, by everything else the build reads.
LOADER_KEYS = {"batch_size", "num_workers", "persistent_workers", "prefetch_factor", "multiprocessing_context",
               "pin_memory"}
_base_datasets: dict[str, tuple] = {}


def built(group: str, cfg):
    """What the chosen option of `group` builds from cfg, as comparable plain values."""
    from trainloop.data.loaders import build_dataloaders, build_datasets, run_tokenizer
    from trainloop.data.sets import PackedBlocks
    from trainloop.model.builder import build_model, build_model_config

    if group == "model":
        model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
        config = model.config.to_dict()
        return config, model.config._attn_implementation, model.is_gradient_checkpointing
    if group == "adapter":  # the trainable parameters, their shapes and how each adapter computes
        from peft.tuners.lora import LoraLayer

        from trainloop.model.adapter import apply_adapter

        if cfg.adapter.name == "none":
            return None
        model = apply_adapter(cfg, build_model(cfg.model, build_model_config(cfg.model, vocab_size=257)))
        trained = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
        lora = [(m.scaling, repr(m.lora_dropout)) for m in model.modules() if isinstance(m, LoraLayer)]
        return trained, lora
    if group == "data":
        # build_datasets reads none of the loader's keys (build_dataloaders alone does): their probes reuse the
        # base's datasets (the walk's first build, kept in _base_datasets)
        read = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in LOADER_KEYS}
        built_by = json.dumps([read, cfg.model.name_or_path, cfg.trainer.seed], sort_keys=True, default=str)
        if built_by in _base_datasets:
            train, valid = _base_datasets[built_by]
        else:
            tokenizer = run_tokenizer(cfg)  # a vision-language model's: its processor's, as the build takes it
            try:
                train, valid = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
            except ConfigError as err:
                if cfg.data.name != "prepared":
                    raise
                return f"refused by the build: {err}"  # data.tokenizer is read: one unlike the shards' is refused
            if not _base_datasets:
                _base_datasets[built_by] = train, valid
        loader, _ = build_dataloaders(cfg.data, train, valid, pin_memory=False)
        context = type(loader.multiprocessing_context).__name__ if loader.multiprocessing_context else None
        blocks = [digest(part.tensors[key] if isinstance(part, PackedBlocks) and key in part.tensors  # its items' stack
                         else torch.stack([part[b][key] for b in range(len(part))]))  # prepared; a prompt's index
                  if isinstance(part[0][key], torch.Tensor) else [part[b][key] for b in range(len(part))]  # prompts' rows
                  for part in (train, valid) for key in sorted(part[0])]
        return (blocks, loader.batch_size, loader.num_workers,
                loader.persistent_workers, loader.prefetch_factor, context)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    if group in ("optimizer", "scheduler"):
        from trainloop.optim.optimizers import build_optimizer, build_scheduler

        optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False)
        if group == "optimizer":
            return (type(optimizer).__name__, repr(sorted(optimizer.defaults.items())),
                    [group["weight_decay"] for group in optimizer.param_groups])
        scheduler = build_scheduler(cfg.scheduler, optimizer, cfg.trainer.max_steps)
        return [scheduler.lr_lambdas[0](step) for step in range(10)]
    if group == "deepspeed":  # what build_deepspeed_plugin hands to accelerate
        from trainloop.parallel.deepspeed_config import deepspeed_config

        ds = cfg.deepspeed
        return (deepspeed_config(cfg, world_size=1) if ds.stage else None), ds.stage == 3 and ds.zero3_init
    if group == "compile":
        from trainloop.model.compile import compile_model, compile_options
        from trainloop.optim.optimizers import build_optimizer, compile_optimizer

        model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
        compile_model(cfg.compile, model)  # lazy: nothing is compiled before the first call
        compiled = [name for name, m in model.named_modules() if m._compiled_call_impl is not None]
        optimizer = build_optimizer(cfg.optimizer, model, on_cuda=False)
        compile_optimizer(cfg, optimizer)  # its step replaced on the instance where compiled
        return compiled, compile_options(cfg.compile) if compiled else None, "step" in vars(optimizer)
    if group == "fsdp":  # the settings FSDP2 applied, read back from a model it sharded
        return sharded_settings(cfg)
    if group == "objective":  # its loss on one batch, of a model whose adapters moved off the reference
        return objective_loss(cfg)
    if group == "precision" and cfg.precision.name == "fp8":  # the layers it swaps for torchao's float8
        from trainloop.model import fp8

        model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
        try:
            return fp8.convert(cfg, model, torch.device("cpu"))
        except ConfigError as err:
            return f"refused by the build: {err}"
    return None  # precision: the rest of what it changes is applied by the Accelerator


def objective_loss(cfg):
    from trainloop.model.adapter import apply_adapter
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import OBJECTIVES, build_objective

    if OBJECTIVES[cfg.objective.name].prompts:
        return generated_loss(cfg)
    torch.manual_seed(0)
    head = OBJECTIVES[cfg.objective.name].head
    model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257), head=head)
    if cfg.adapter.name != "none":
        model = apply_adapter(cfg, model, head)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(0, 0.2)
    ids = torch.randint(0, 257, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(16) < 4, -100)
    row = OBJECTIVES[cfg.objective.name]
    if row.pairs:
        batch = {"chosen_input_ids": ids[:2], "chosen_labels": labels[:2], "rejected_input_ids": ids[2:],
                 "rejected_labels": labels[2:]}
    elif row.unpaired:  # desirable and not, each with a mismatched sequence
        batch = {"input_ids": ids[:2], "labels": labels[:2], "kl_input_ids": ids[2:], "kl_labels": labels[2:],
                 "label": torch.tensor([True, False])}
    else:
        batch = {"input_ids": ids, "labels": labels}
    objective = started(build_objective(cfg, "cpu"), cfg, model)  # with distill's teacher, as the build hands it over
    with torch.no_grad():
        return objective.batch_loss(model, batch).summed.item()


def generated_loss(cfg):
    """An objective that generates its batches (grpo), run as a step runs it on one process: the
    completions it samples for two prompts of the real data, scored by the reward functions, with
    their advantages and the log-probabilities kept from before the update; then, after an update
    moved the policy (so that the ratio to the sampling policy is not 1), the loss and its gradient;
    and which of the next steps draw new prompts."""
    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.model.adapter import apply_adapter
    from trainloop.data.loaders import build_datasets, build_tokenizer
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective
    from trainloop.parallel import build_strategy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a launched run (helpers.clean_env): 2 threads spin on 2 shared cores
    reset_accelerate()
    try:
        tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
        train, _ = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
        items = [train[0], train[1]]
        batch = {"prompt_ids": torch.stack([i["prompt_ids"] for i in items]),
                 "prompt_mask": torch.stack([i["prompt_mask"] for i in items]), "row": [i["row"] for i in items],
                 "index": torch.stack([i["index"] for i in items])}
        torch.manual_seed(0)
        model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
        if cfg.adapter.name != "none":
            model = apply_adapter(cfg, model)
        moved = torch.Generator().manual_seed(0)

        def move(scale: float):  # the policy away from the reference (adapters off), or from the sampling policy
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if parameter.requires_grad and ("lora_B" in name or cfg.adapter.name == "none"):
                        parameter.add_(torch.randn(parameter.shape, generator=moved) * scale)

        strategy = build_strategy(cfg, build_accelerator(cfg))
        objective = build_objective(cfg, "cpu")
        objective.strategy = strategy  # as start() sets it in a run (the entropy mask's collective)
        if cfg.adapter.name != "none":
            move(0.2)
        generated = objective.step_batches(strategy, model, [batch], 0)
        move(1.0)  # an update: far enough that some ratios leave [1 - epsilon, 1 + epsilon_high]
        losses = []
        for micro in generated:
            loss = objective.batch_loss(model, micro).summed
            loss.backward()
            losses.append(loss.item())
        gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        rollouts = [{key: digest(value.detach().float()) for key, value in sorted(micro.items())} for micro in generated]
        return losses, digest(gradient), rollouts, [objective.draws(step) for step in range(3)]
    finally:
        reset_accelerate()
        torch.set_num_threads(threads)


def sharded_settings(cfg):
    """Shard the model as a run would, on a 1-process gloo group of this test's own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from types import SimpleNamespace

    from trainloop.parallel.sharding import shard_model, sharding_settings
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.parallel.fsdp2 import FSDP2

    if cfg.fsdp.name == "none":
        return None
    model = build_model(cfg.model, build_model_config(cfg.model, vocab_size=257))
    # an in-process run before this one in the same worker (DeepSpeed's 1-process group) may have left one
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        shard_model(cfg, model, torch.device("cpu"), init_device_mesh("cpu", (1,)))
        first_micro_batch = cfg.trainer.gradient_accumulation_steps == 1  # the last of its step only then
        with FSDP2.gradient_sync(SimpleNamespace(cfg=cfg), model, enabled=first_micro_batch):  # as the loop runs it
            return sharding_settings(model)
    finally:
        if owned:
            dist.destroy_process_group()


def refusal(cfg, overrides) -> str | None:
    try:
        validate(cfg)
    except ConfigError as err:
        return f"validate: {err}"
    try:
        check_command_line(cfg, overrides)
    except ConfigError as err:
        return str(err)
    return None


def test_every_key_is_probed(files):
    groups = {group for group, _ in OPTIONS}
    every = set().union(*(group_keys(g) for g in groups))
    assert every == set(probes(files)) | set(NOT_PROBED) | SELECTORS


@pytest.mark.slow
@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_a_key_the_option_ignores_is_refused_naming_the_option(group, option, files):
    if group == "data":  # model=hf here would make the model's own tokenizer the data's
        base = [f"data={option}", *([f"data.path={files[CORPUS[option] + '_a']}"] if option in CORPUS else []),
                *PAIRED.get(option, [])]
    elif group == "model":
        base = [f"model={option}", *([f"model.name_or_path={files['model_a']}"] if option == "hf" else [])]
    else:
        base = [f"{group}={option}", *NEEDS.get((group, option), []),
                *(generating(files) if (group, option) == ("objective", "grpo") else [])]
    base = ["+preset=smoke", *base]
    _base_datasets.clear()
    before = built(group, compose(*base))
    if group == "objective":  # seeded: a loss that moved by itself would make every key look read
        assert built(group, compose(*base)) == before
    silently_ignored, over_refused = [], []
    for key, value in probes(files, option if group == "data" else "files",
                             option if group == "objective" else "dpo").items():
        override = f"{key}={json.dumps(value) if isinstance(value, list) else value}"
        if not key.startswith(group + ".") or override in base:
            continue  # a key the option needs (data.path, objective.rewards) is probed with another value
        overrides = [*base, override]
        cfg = compose(*overrides)
        refused = refusal(cfg, overrides)
        if refused and refused.startswith("validate:"):
            continue  # a combination that cannot work: refused before anything is built
        effect = built(group, cfg) != before
        if not refused and not effect:
            silently_ignored.append(key)
        if refused and effect:
            over_refused.append(f"{key}: {refused}")
        if refused:
            assert key in refused and "has no effect unless" in refused, refused
    assert not silently_ignored, f"{group}={option} accepts these keys but builds nothing different"
    assert not over_refused, f"{group}={option} refuses keys that change what it builds"


@pytest.mark.parametrize("sync", [True, False])
def test_fsdp_sync_each_batch_decides_whether_a_steps_first_micro_batch_reduce_scatters(sync):
    """The walk above probes fsdp.sync_each_batch with one micro-batch a step, where it is refused
    (every micro-batch is its step's last and reduces); with two, the first one's gradients are
    reduce-scattered into the shards only with sync_each_batch=true."""
    overrides = ["+preset=smoke", "fsdp=full_shard", "trainer.gradient_accumulation_steps=2",
                 f"fsdp.sync_each_batch={str(sync).lower()}"]
    cfg = compose(*overrides)
    check_command_line(cfg, overrides)
    assert sharded_settings(cfg)["reduce_grads"] is sync


def test_auto_batch_size_budget_needs_auto_batch_size():
    overrides = ["trainer.auto_batch_size_budget_mb=512"]
    with pytest.raises(ConfigError, match="has no effect unless trainer.auto_batch_size=true"):
        check_command_line(compose(*overrides), overrides)
    overrides.append("trainer.auto_batch_size=true")
    check_command_line(compose(*overrides), overrides)


@pytest.mark.parametrize("override,option", [("data.path=my.jsonl", "data=files"),
                                             ("model.name_or_path=some_model_dir", "model=hf")])
def test_the_command_line_refuses_a_key_the_default_option_ignores(tmp_path, override, option):
    proc = warm(1, [override, f"hydra.run.dir={tmp_path / 'run'}"],
                  cwd=tmp_path, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert override.split("=")[0] in proc.stderr and option in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_logging_trackers_is_read(tmp_path, monkeypatch):
    """logging.* is no group with options, so the walk above does not reach it: the trackers a run
    builds (trainloop/observe/trackers.py, before accelerate starts them) follow logging.trackers."""
    from accelerate.tracking import GeneralTracker

    from trainloop.observe.trackers import TRACKERS

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # building the MLflow tracker sets it

    def built_trackers(*overrides: str) -> list:
        cfg = compose("+preset=smoke", *overrides)
        validate(cfg)
        return [TRACKERS[name].build(tmp_path) for name in cfg.logging.trackers]

    def names(trackers) -> list[str]:  # accelerate's tracker classes (trainloop's TensorBoard subclasses one)
        assert all(isinstance(t, GeneralTracker) for t in trackers)
        return [t.name for t in trackers]

    assert names(built_trackers()) == ["tensorboard"]
    assert names(built_trackers("logging.trackers=[mlflow,wandb]")) == ["mlflow", "wandb"]
    assert built_trackers("logging.trackers=[]") == []
