"""Vision-language models: a tiny LLaVA built from its shape (model.arch=llava: a CLIP vision tower, a projector,
a Llama) or a pretrained one (model=hf, a directory with its processor), the processor that turns a conversation
with images into tokens and pixels, and the parts model.freeze names."""

from __future__ import annotations

import weakref

from trainloop.config.sections import ModelConfig
from trainloop.errors import ConfigError

IMAGE_TOKEN = "<image>"  # the tiny model's placeholder, which its processor expands into the image's tokens

# The tiny model's template (the built-in chat template's layout): a user turn renders its image parts as the
# placeholder, in their place among the text parts; an assistant's reply is inside {% generation %}, so the
# trained tokens are transformers' assistant mask, as TRL's collator takes it (assistant_only_loss).
VISION_CHAT_TEMPLATE = (
    "{% macro text(content, images) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content %}{% if part['type'] == 'image' and images %}" + IMAGE_TOKEN +
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ text(message['content'], false) }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ text(message['content'], true) }}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# the model's parts model.freeze may name -> the attribute transformers' vision-language models give each
PARTS = {"vision": ("vision_tower", "vision_model", "visual"), "projector": ("multi_modal_projector", "connector")}

# tokenizer -> its processor: what the data formats that read images (data=vision_chat) find from the run's tokenizer
_PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_vision(config) -> bool:
    """The model config is a vision-language model's (a vision tower beside its language model)."""
    return getattr(config, "vision_config", None) is not None


def tiny_config(cfg: ModelConfig, vocab_size: int):
    """model.arch=llava: LLaVA's layout at the tiny model's shape, its vision tower a CLIP encoder of
    model.vision_layers blocks, model.vision_hidden_size wide, over model.patch_size patches of an image
    model.image_size pixels square. Its image token's id is the processor's (the build hands it in with the
    tokenizer's special token ids)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    width = cfg.vision_hidden_size
    text = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size or 4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, use_cache=False,
    )
    vision = CLIPVisionConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=cfg.vision_layers,
                              num_attention_heads=max(1, width // 32), image_size=cfg.image_size,
                              patch_size=cfg.patch_size)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=None,
                       vision_feature_select_strategy="default", vision_feature_layer=-1,
                       tie_word_embeddings=cfg.tie_embeddings)


def vision_processor(cfg: ModelConfig, tokenizer=None):
    """The processor of the run's images and text: model=hf's own (AutoProcessor from model.name_or_path);
    for model.arch=llava, one made here around `tokenizer` (the built-in bytes), with the image token added
    and the tiny model's chat template. Its tokenizer is the run's (processor_of finds the processor from it)."""
    if cfg.name == "hf":
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(cfg.name_or_path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: no processor could be loaded ({err}); "
                              "data=vision_chat needs a vision-language model directory with its processor "
                              "(processor_config.json or preprocessor_config.json, and the tokenizer)") from None
        except ImportError as err:  # a class of it needs a library: Qwen2-VL's video processor, torchvision
            import torch

            why = next(line for line in [*str(err).splitlines(), type(err).__name__] if line.strip()).split(". ")[0]
            match = (f" (the torchvision release made for torch {torch.__version__.split('+')[0]})"
                     if "torchvision" in why.lower() else "")
            raise ConfigError(f"model.name_or_path={cfg.name_or_path!r}: its processor cannot load here: {why}; "
                              f"install that library into this environment{match} and run again") from None
        if getattr(processor, "image_processor", None) is None:
            raise ConfigError(f"model.name_or_path={cfg.name_or_path!r} has no image processor: data=vision_chat "
                              "needs a vision-language model's processor (AutoProcessor) beside its weights")
    else:
        import transformers
        from transformers import LlavaProcessor

        # the PIL one where torchvision is not installed (the default CLIP processor asks for it)
        images = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        side = cfg.image_size
        processor = LlavaProcessor(
            image_processor=images(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
            tokenizer=tokenizer, patch_size=cfg.patch_size, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=VISION_CHAT_TEMPLATE)
    if processor.chat_template and not processor.tokenizer.chat_template:  # what template_of reads
        processor.tokenizer.chat_template = processor.chat_template
    _PROCESSORS[processor.tokenizer] = processor
    return processor


def processor_of(tokenizer):
    """The processor whose tokenizer `tokenizer` is (vision_processor's), or None for a text model's."""
    return _PROCESSORS.get(tokenizer)


def image_token_id(processor) -> int:
    return processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", IMAGE_TOKEN))


def part(model, name: str):
    """The module of a vision-language model's part (PARTS) through its wrappers (peft's, DDP's), or None."""
    import torch

    for module in model.modules():  # the first module holding one: the model's own (peft's wrappers hold none)
        for attr in PARTS[name]:
            found = module._modules.get(attr)
            if isinstance(found, torch.nn.Module):
                return found
    return None


def language_linears(model) -> list[str]:
    """The full names of a vision-language model's linear layers outside its vision tower and projector and
    other than its output layer: what adapter=lora adapts by default (the language model alone)."""
    import torch

    others = [m for m in (part(model, "vision"), part(model, "projector")) if m is not None]
    skipped = {id(p) for m in others for p in m.modules()} | {id(model.get_output_embeddings())}
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in skipped]


def freeze(model, names: list[str]) -> int:
    """Take the parts `names` (model.freeze) out of training; returns the parameters frozen."""
    frozen = 0
    for name in names:
        module = part(model, name)
        if module is None:
            raise ConfigError(f"model.freeze={list(names)}: {type(model).__name__} has no {name} part "
                              f"(looked for {', '.join(PARTS[name])}); drop it from model.freeze")
        for p in module.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def problems(cfg) -> list[str]:
    """The checks of a vision-language configuration (config.validate collects them)."""
    m, problems = cfg.model, []
    unknown = [n for n in m.freeze if n not in PARTS]
    if unknown:
        problems.append(f"model.freeze={list(m.freeze)}: {unknown} not among the parts {', '.join(PARTS)}")
    if m.name == "tiny" and m.arch == "llava":
        if m.image_size % m.patch_size:
            problems.append(f"model.image_size={m.image_size} is not a multiple of model.patch_size={m.patch_size}")
        if m.vision_hidden_size % 32 and m.vision_hidden_size > 32:
            problems.append(f"model.vision_hidden_size={m.vision_hidden_size}: the vision tower's heads are 32 "
                            "wide; give a multiple of 32")
        if cfg.data.name != "vision_chat":
            problems.append(f"model.arch=llava trains on images: set data=vision_chat (data={cfg.data.name} is text; "
                            "a text model is model.arch=llama)")
    if cfg.data.name != "vision_chat":
        return problems
    if m.name == "tiny" and m.arch != "llava":
        problems.append(f"data=vision_chat trains a vision-language model, and model.arch={m.arch} reads text alone: "
                        "set model.arch=llava, or model=hf with a vision-language model's directory")
    if m.name == "hf" and cfg.data.tokenizer:
        problems.append(f"data.tokenizer={cfg.data.tokenizer} with model=hf and data=vision_chat: the model's "
                        "processor (model.name_or_path) brings its own tokenizer, which its image tokens are part of; "
                        "drop data.tokenizer")
    return problems
