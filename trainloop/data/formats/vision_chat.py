"""data=vision_chat: conversations with images, in TRL's format (json, jsonl, parquet). A message's content is text,
or a list of parts, {"type": "text", "text": ...} and {"type": "image"}; the row's images column (data.images_field)
holds one image per image part, in order (a conversation of text alone gets its images before its first user turn's
text, as TRL places them): a file path (relative to the data file's folder, or absolute), or the
image's bytes (parquet, as `datasets`' Image feature stores them: {"bytes": ..., "path": ...}).

The processor (trainloop.model.vision) renders each conversation with the chat template and expands every image
part into the model's image tokens. The trained tokens are the assistant's replies, as the template's
{% generation %} markers say (exactly TRL's assistant_only_loss), or every token but the images'
(data.train_on=all); an image's tokens are never a target. Each conversation is one row, padded on the right to
data.seq_len (data.packing=none): its pixels go with its tokens, and a row cut short may not cut an image's tokens.
The tokens are made once; the pixels as each batch is read (the DataLoader's workers, data.num_workers), by the
processor's image processor, so a large image set is never held decoded."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from trainloop.config.sections import DataConfig
from trainloop.data.chat_template import GENERATION_MARKER, TemplateConfig, template_of
from trainloop.data.formats.base import DataFormat
from trainloop.data.formats.rows import (
    data_files, file_places, json_kind, read_rows, root_cause, struct_columns_as_json,
)
from trainloop.data.tokenizer import IGNORE, pad_id
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

ROLES = ("system", "user", "assistant")
PARTS = '{"type": "text", "text": ...} or {"type": "image"}'


@dataclass
class VisionChatConfig(TemplateConfig):
    messages_field: str = "messages"  # the column holding a list of {role, content} messages
    images_field: str = "images"  # the column of each row's images, one per {"type": "image"} part: paths or bytes


def content_problem(content, m: int, role: str) -> tuple[str | None, int]:
    """(what makes message m's content unusable, or None; its image parts)."""
    if isinstance(content, str):
        return None, 0
    if not isinstance(content, list):
        return f"message {m} ({role}) has a content that is {json_kind(content)}, not text or a list of {PARTS}", 0
    images = 0
    for k, part in enumerate(content, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            if role != "user":
                return f"message {m} ({role}) part {k} is an image; only the user's messages hold images", 0
            images += 1
        elif kind != "text" or not isinstance(part.get("text"), str):
            return f"message {m} ({role}) part {k} is not one of {PARTS}", 0
    return None, images


def conversation_problem(messages) -> tuple[str | None, int]:
    """(what makes a conversation unusable, or None; its image parts)."""
    if not isinstance(messages, list) or not messages:
        return f"is {json_kind(messages)}, not a list of {{role, content}} messages", 0
    images = 0
    for m, message in enumerate(messages, 1):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            return f"message {m} has role {role!r}; the roles are {', '.join(ROLES)}", 0
        problem, n = content_problem(message.get("content"), m, message["role"])
        if problem:
            return problem, 0
        images += n
    return None, images


def placed(messages: list[dict], images: int) -> list[dict]:
    """A conversation whose contents are all text, with images: the images placed before the first user turn's
    text, as TRL places them (prepare_multimodal_messages); any other conversation as it is."""
    if not images or any(isinstance(m["content"], list) for m in messages):
        return messages
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        return messages
    parts = [*({"type": "image"} for _ in range(images)), {"type": "text", "text": messages[first]["content"]}]
    return [{**m, "content": parts} if i == first else m for i, m in enumerate(messages)]


def undecoded_images(rows, column: str):
    """`rows` with the images column as `datasets` stores an Image feature ({"bytes", "path"}), not decoded: parquet
    written by `datasets` (an Image or a list of them) decodes into PIL images otherwise."""
    import datasets

    feature = rows.features[column]
    inner = getattr(feature, "feature", None)
    if isinstance(feature, datasets.Image):
        return rows.cast_column(column, datasets.Image(decode=False))
    if isinstance(inner, datasets.Image):
        return rows.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return rows


def row_files(path: str) -> list[str]:
    """The file each row of read_rows(path) comes from, in order (relative image paths are its folder's)."""
    builder, files = data_files(path)
    return [file for file in files for _ in file_places(path, builder, file)]


def image_source(image, folder: Path):
    """A row's image as the loader reads it: a path (str), or its bytes."""
    if isinstance(image, dict):  # datasets' Image feature: bytes, else a path
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, str) and image:
        path = Path(image).expanduser()
        return str(path if path.is_absolute() else folder / path)
    return None


def image_problem(source) -> str | None:
    """Why `source` cannot be a row's image, or None: from the file's header and its own checks (PIL's verify),
    without decoding the pixels, which build() decodes once for the processor."""
    if source is None:
        return "is neither a path nor an image's bytes"
    if isinstance(source, str) and not Path(source).is_file():
        return f"{source!r}: no such file"
    from trainloop.data.sets import verify_image

    try:
        verify_image(source)
    except Exception as err:  # noqa: BLE001 - whatever PIL raises for a file that is not an image
        return not_an_image(source, err)
    return None


def not_an_image(source, err: Exception) -> str:
    return f"{source if isinstance(source, str) else 'its bytes'!r} is not an image ({root_cause(err)})"


def with_images(messages: list[dict], images: list) -> list[dict]:
    """The messages with each image part holding its image, in order, as processors' templates take them."""
    pictures = iter(images)
    return [{**m, "content": [{**p, "image": next(pictures)} if p.get("type") == "image" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages]


def image_digest(sources: list) -> int:
    """A row's images hashed (what the data fingerprint sees of them), as a signed 63-bit integer."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source if isinstance(source, bytes) else Path(source).read_bytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


class VisionChat(DataFormat):
    name = "vision_chat"
    keys = VisionChatConfig
    fields = {"data.messages_field": "json", "data.images_field": "json"}
    train_on = ("assistant", "all")
    masked = True
    images = True
    path = "json, jsonl or parquet rows of messages and their images"

    # the keys every format that reads rows reads, but not this one: why, said where one is refused
    UNREAD = {"data.num_proc": "its rows are tokenized in the run's process; the images are decoded as batches are "
                               "read, in data.num_workers loader workers",
              "data.sources": "a mixture of conversations with images is not built yet; give data.path"}

    def reads(self) -> tuple[str, ...]:
        return tuple(key for key in super().reads() if key not in self.UNREAD)

    def unread_hint(self, key: str) -> str:
        return self.UNREAD.get(key, "")

    def problems(self, cfg) -> list[str]:
        d, problems = cfg.data, []
        if d.sources is not None:
            problems.append(f"data.sources with data=vision_chat: {self.UNREAD['data.sources']}")
        if d.packing != "none":
            problems.append(f"data.packing={d.packing}: data=vision_chat pads each conversation to data.seq_len (its "
                            "images' pixels go with its tokens); set data.packing=none")
        elif d.overlong == "split":
            problems.append("data.overlong=split: a conversation's pieces would lose its images; choose truncate or "
                            "drop")
        return problems

    def load(self, cfg: DataConfig, tokenizer=None):
        """[(row number, messages, image sources)] of the rows, each checked (its images by their headers): a row
        that cannot be used is one line naming its file and line; rows with nothing to learn are skipped and
        counted."""
        rows = undecoded_images(read_rows(cfg.path, self.columns(cfg), list(self.fields)), cfg.images_field)
        rows = struct_columns_as_json(rows, [cfg.messages_field])
        files = row_files(cfg.path)
        kept, skipped = [], Counter()
        for r, (messages, images) in enumerate(zip(rows[cfg.messages_field], rows[cfg.images_field])):
            problem, _ = conversation_problem(messages)
            if problem:
                raise ConfigError(f"{self.place(cfg, r)}: data.messages_field={cfg.messages_field!r} {problem}; "
                                  "fix or remove that row")
            images = [] if images is None else images if isinstance(images, list) else [images]
            messages = placed(messages, len(images))
            parts = conversation_problem(messages)[1]
            if parts != len(images):
                more = ("an image part with no image" if parts > len(images) else "more images than image parts")
                raise ConfigError(f"{self.place(cfg, r)}: {more}: {parts} {{\"type\": \"image\"}} part(s) and "
                                  f"{len(images)} image(s) in data.images_field={cfg.images_field!r}; give one image "
                                  "per image part, in order")
            folder = Path(files[r]).parent
            sources = [image_source(image, folder) for image in images]
            for k, source in enumerate(sources, 1):
                problem = image_problem(source)
                if problem:
                    raise self.bad_image(cfg, r, k, problem)
            roles = [m["role"] for m in messages]
            if cfg.train_on == "assistant" and "assistant" not in roles:
                skipped["no assistant reply"] += 1
                continue
            kept.append((r, messages, sources))
        if not kept:
            raise ConfigError(f"none of the {len(rows)} rows of {cfg.path} can be trained: "
                              + ", ".join(f"{n} with {why}" for why, n in skipped.items()))
        if skipped:
            log.warning("data=vision_chat rows of %s: skipped %d (%s)", cfg.path, sum(skipped.values()),
                        ", ".join(f"{n} with {why}" for why, n in skipped.items()))
        return kept

    def bad_image(self, cfg: DataConfig, r: int, k: int, problem: str) -> ConfigError:
        return ConfigError(f"{self.place(cfg, r)}: data.images_field={cfg.images_field!r} image {k} {problem}; fix or "
                           "remove that row")

    def chat_template(self, cfg: DataConfig, tokenizer) -> str:
        return template_of(cfg, tokenizer)

    def processor(self, cfg: DataConfig, tokenizer):
        """The run's processor (trainloop.model.vision.processor_of), whose chat template can label the rows."""
        from trainloop.model.vision import processor_of

        processor = processor_of(tokenizer)
        if processor is None:
            raise ConfigError("data=vision_chat needs a vision-language model and its processor: model.arch=llava, "
                              "or model=hf with a vision-language model directory (AutoProcessor)")
        if cfg.train_on == "assistant" and not GENERATION_MARKER.search(self.chat_template(cfg, tokenizer)):
            raise ConfigError("data=vision_chat with data.train_on=assistant takes the assistant's tokens from the "
                              "chat template's {% generation %} markers (as TRL does), and this template has none: "
                              "give one with them (data.chat_template=FILE), or set data.train_on=all")
        return processor

    def encoded(self, cfg: DataConfig, tokenizer, processor, examples):
        """(input ids, labels) of each of `examples` (load's rows), whole (data.seq_len not applied): its
        conversation rendered by the chat template and its images' tokens by `processor` (self.processor's), each
        image decoded once; the labels are the trained tokens (data.train_on), never an image's."""
        from trainloop.data.sets import open_image
        from trainloop.model.vision import image_token_id

        template, assistant = self.chat_template(cfg, tokenizer), cfg.train_on == "assistant"
        image_token = image_token_id(processor)
        for r, messages, sources in examples:
            pictures = []
            for k, source in enumerate(sources, 1):
                try:
                    pictures.append(open_image(source))
                except Exception as err:  # noqa: BLE001 - a file whose header passed but whose pixels do not decode
                    raise self.bad_image(cfg, r, k, not_an_image(source, err)) from err
            out = processor.apply_chat_template(
                [with_images(messages, pictures)], chat_template=template, tokenize=True,
                return_dict=True, return_assistant_tokens_mask=assistant,
                processor_kwargs={"add_special_tokens": False})
            row = out["input_ids"][0]
            row = row.tolist() if hasattr(row, "tolist") else list(row)
            marked = out["assistant_masks"][0] if assistant else [1] * len(row)
            marked = marked.tolist() if hasattr(marked, "tolist") else list(marked)
            yield row, [t if m and t != image_token else IGNORE for t, m in zip(row, marked)]

    def tokenize(self, cfg: DataConfig, tokenizer, examples, desc: str = "tokenize"):
        """input_ids and labels of each of `examples`, whole (python -m trainloop.inspect shows them)."""
        rows = list(self.encoded(cfg, tokenizer, self.processor(cfg, tokenizer), examples))
        return {"input_ids": [ids for ids, _ in rows], "labels": [labels for _, labels in rows]}

    def build(self, cfg: DataConfig, tokenizer, seed: int):
        """The rows as VisionRows: tokens and labels made here, once; pixels as batches are read."""
        import torch

        from trainloop.data.packing import split_documents
        from trainloop.data.sets import VisionRows
        from trainloop.model.vision import image_token_id

        processor = self.processor(cfg, tokenizer)  # before the rows are read
        kept = self.load(cfg, tokenizer)
        image_token, pad, length = image_token_id(processor), pad_id(tokenizer), cfg.seq_len
        ids, labels, masks, images, digests = [], [], [], [], []
        dropped = Counter()
        for (_, _, sources), (row, target) in zip(kept, self.encoded(cfg, tokenizer, processor, kept)):
            if len(row) > length:
                if cfg.overlong == "drop" or image_token in row[length:]:
                    dropped["longer than data.seq_len" + ("" if cfg.overlong == "drop" else
                                                          " where the cut would split an image's tokens")] += 1
                    continue
                row, target = row[:length], target[:length]
            if all(t == IGNORE for t in target[1:]):
                dropped["no target token left"] += 1
                continue
            fill = length - len(row)
            ids.append(row + [pad] * fill)
            labels.append(target + [IGNORE] * fill)
            masks.append([1] * len(row) + [0] * fill)
            images.append(sources)
            digests.append(image_digest(sources))
        if dropped:
            log.warning("data=vision_chat: dropped %d conversation(s) (%s)", sum(dropped.values()),
                        ", ".join(f"{n} {why}" for why, n in dropped.items()))
        held_out = set(split_documents(len(ids), cfg.validation_fraction, seed).tolist())
        parts = []
        for keep in (lambda i: i not in held_out, lambda i: i in held_out):
            rows = [i for i in range(len(ids)) if keep(i)]
            tensors = {"input_ids": torch.tensor([ids[i] for i in rows]),
                       "labels": torch.tensor([labels[i] for i in rows]),
                       "attention_mask": torch.tensor([masks[i] for i in rows]),
                       "image_digest": torch.tensor([digests[i] for i in rows], dtype=torch.int64)}
            parts.append(VisionRows(tensors, [images[i] for i in rows], processor.image_processor))
        return parts[0], parts[1]
