"""An example data=vision_chat set: a square of one of four colours on a light background, at a random place and size,
and the conversation "What colour is the square?" -> the colour (TRL's format: messages with an image part, and the
image's path in the images column).

    python scripts/vision_squares.py DIR [--rows 300] [--seed 0]
    python -m trainloop model.arch=llava data=vision_chat data.path=DIR/train.jsonl

writes DIR/images/N.png and DIR/train.jsonl (paths relative to it). docs/vision.md walks through it; the tests train
on it and judge the model by asking about squares it has not seen (`squares`)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (230, 200, 30)}
QUESTION = "What colour is the square?"
SIDE = 48  # pixels


def squares(count: int, seed: int) -> list[tuple[str, object]]:
    """(colour, PIL image) pairs drawn from the seed."""
    from PIL import Image

    rng, drawn = random.Random(seed), []
    for _ in range(count):
        colour = rng.choice(sorted(COLOURS))
        image = Image.new("RGB", (SIDE, SIDE), (240, 240, 235))
        size = rng.randint(SIDE // 3, SIDE * 2 // 3)
        x, y = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
        image.paste(COLOURS[colour], (x, y, x + size, y + size))
        drawn.append((colour, image))
    return drawn


def conversation(colour: str | None) -> list[dict]:
    """The question about one image, with the answer when `colour` is given."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    if colour is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": colour}]})
    return messages


def write(directory: Path, rows: int = 300, seed: int = 0) -> Path:
    """DIR/images/N.png and DIR/train.jsonl; returns the jsonl's path."""
    (directory / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for n, (colour, image) in enumerate(squares(rows, seed)):
        image.save(directory / "images" / f"{n}.png")
        lines.append(json.dumps({"messages": conversation(colour), "images": [f"images/{n}.png"]}))
    path = directory / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.directory, args.rows, args.seed))


if __name__ == "__main__":
    main()
