"""The training sets a run reads an item at a time: TrainingSet, what a run asks of every one; the blocks of
tokenized text (PackedBlocks, which trainloop.data.packing plans), and the rows of the pair, unpaired and
prompt formats (trainloop.data.formats)."""

from __future__ import annotations

from functools import cached_property

import torch
from torch.utils.data import Dataset

from trainloop.model.attention import documents_of


class TrainingSet(Dataset):
    """What a run asks of a training set, answered here as a plain one answers: a set of blocks the
    run shuffles itself (PackedBlocks, PlannedBlocks). A set with an order of its own (a mixture's
    schedule, trainloop.data.mixture) overrides them. The run and the loop call these directly.

    - orders_itself: True if its items come in its own order, to be read in order (no shuffle).
    - whole_batches(global_batch): trim an epoch to whole global batches, before the order is made.
    - set_epoch(epoch): called at the start of each epoch, before its items are read.
    """

    orders_itself = False

    def whole_batches(self, global_batch: int) -> None:
        """A plain set keeps every block: the order (trainloop.data.order) drops the tail of an epoch."""

    def set_epoch(self, epoch: int) -> None:
        """A plain set is the same every epoch: the order reshuffles it."""


class PackedBlocks(TrainingSet):
    """Training blocks: rows of [num_blocks, seq_len] tensors, one dict of them per block.

    labels are the input ids with IGNORE where no loss is taken; position_ids restart at 0 at
    each packed row (the model then keeps attention inside the row); attention_mask only for
    data.packing=none, where rows are padded on the right.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None):
        if labels is None:
            labels = input_ids
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        self.tensors = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if attention_mask is not None:
            self.tensors["attention_mask"] = attention_mask

    @property
    def blocks(self) -> torch.Tensor:
        return self.tensors["input_ids"]

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: tensor[i] for key, tensor in self.tensors.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The DataLoader's read of a batch: each column gathered by one op, where collating the items would
        take one a row and a column, then a stack a column (trainloop.data.loaders.collate passes it on).
        position_ids only where a row restarts them (one sequence a row: the model counts them itself), and
        with them each token's document (`documents`, which stays on the host: trainloop.model.attention)."""
        index = torch.tensor(indices)
        keep_positions = "position_ids" in self.tensors and any(self.restarts[i] for i in indices)
        batch = {key: tensor.index_select(0, index) for key, tensor in self.tensors.items()
                 if keep_positions or key != "position_ids"}
        if keep_positions:
            batch["documents"] = documents_of(batch["position_ids"])
        return batch

    @cached_property
    def restarts(self) -> list[bool]:
        """Whether each block's position ids restart (packed documents), made once for every read."""
        return restarting(self.tensors["position_ids"]).tolist()


def restarting(position_ids: torch.Tensor) -> torch.Tensor:
    """Per row, whether its position ids restart (packed documents) rather than count 0..seq-1 (one sequence)."""
    return (position_ids != torch.arange(position_ids.shape[-1])).any(dim=-1)


class PairBlocks(PackedBlocks):
    """data=preference's pairs (trainloop.data.formats.preference) as [pairs, seq_len] tensors: chosen_input_ids, chosen_labels,
    rejected_input_ids, rejected_labels; padded on the right, so causal attention needs no mask."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @property
    def blocks(self) -> torch.Tensor:
        return self.tensors["chosen_input_ids"]


class UnpairedRows(PackedBlocks):
    """data=unpaired's rows (trainloop.data.formats.unpaired) as [rows, seq_len] tensors: input_ids and
    labels, kl_input_ids and kl_labels (the prompt with the row before's completion), and label ([rows],
    true: desirable); padded on the right, so causal attention needs no mask."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors


class PromptRows(PackedBlocks):
    """Prompts as [prompts, seq_len] tensors, padded on the left: prompt_ids, prompt_mask (1 on the
    prompt's tokens), and row_digest (each row's hash, so the data fingerprint sees its other
    columns); each item also carries `row`, the whole row as JSON, for the reward functions, and
    `index`, its place in the set (what its completions' draws are keyed by)."""

    def __init__(self, tensors: dict[str, torch.Tensor], rows: list[str]):
        self.tensors, self.rows = tensors, rows

    @property
    def blocks(self) -> torch.Tensor:
        return self.tensors["prompt_ids"]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | str]:
        return {"prompt_ids": self.tensors["prompt_ids"][i], "prompt_mask": self.tensors["prompt_mask"][i],
                "row": self.rows[i], "index": torch.tensor(i)}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return [self[i] for i in indices]  # rows carry strings: torch's collate makes the batch


class VisionRows(PackedBlocks):
    """data=vision_chat's conversations (trainloop.data.formats.vision_chat) as [rows, seq_len] tensors: input_ids,
    labels and attention_mask, padded on the right, and image_digest (each row's images hashed, for the data
    fingerprint); and each row's images (paths or bytes), which the processor's image processor turns into
    pixels as a batch is read: pixel_values (and what else it gives, e.g. image_grid_thw), every image of the
    batch's rows in order, as the model takes them."""

    def __init__(self, tensors: dict[str, torch.Tensor], images: list[list], image_processor):
        self.tensors, self.images, self.image_processor = tensors, images, image_processor

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: value[0] if key in self.tensors else value for key, value in self.__getitems__([i]).items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        index = torch.tensor(indices)
        batch = {key: tensor.index_select(0, index) for key, tensor in self.tensors.items() if key != "image_digest"}
        pictures = [open_image(source) for i in indices for source in self.images[i]]
        if pictures:
            batch.update(self.image_processor(pictures, return_tensors="pt"))
        return batch


def _opened(source):
    """PIL's image at `source` (a path, or its bytes), opened: its header read, no pixel decoded yet."""
    import io

    from PIL import Image

    return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def open_image(source):
    """The image at `source` (a path, or its bytes), decoded, in RGB."""
    with _opened(source) as image:
        return image.convert("RGB")


def verify_image(source) -> None:
    """Raises what PIL raises where `source` is not an image, from its header and PIL's own checks (verify),
    without decoding its pixels."""
    with _opened(source) as image:
        image.verify()


def materialize(blocks) -> PackedBlocks:
    """Planned blocks gathered into tensors: data the run tokenized itself fits in memory."""
    items = [blocks[b] for b in range(len(blocks))]
    return PackedBlocks(**{key: torch.stack([item[key] for item in items]) for key in items[0]})
