"""The shapes task: count the filled squares drawn on a picture (1 to 4), answer with the digit.

Pictures are 84x84 PNGs (the tiny VLM sees them as 6x6 patches of 14 pixels, 9 tokens after its 2x2
merge): 1-4 squares of 14-22 pixels in random colours, each in its own cell of a 3x3 grid of 28-pixel
cells (the region one merged token covers), at a random place in the cell, on white.
Rows: ``train.jsonl`` and ``eval.jsonl`` (``prompt`` with one ``<image>``, ``images``, ``label``) for
GRPO and its held-out evaluation, ``sft.jsonl`` (``messages`` with the right answer, ``images``) for
the warm start. Held-out pictures are drawn from their own seed.

    python -m examples.vlm_shapes.data --out outputs/vlm-shapes/data --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "<image>How many squares are in the picture? Answer with one digit."
SIZE = 84
CELL = 28
MAX_COUNT = 4


def draw(rng: random.Random, count: int):
    """``count`` squares in distinct cells of a 3x3 grid of 28-pixel cells (one cell: the 2x2 patches the
    vision tower merges into one token), 14-22 pixels each, at a random offset in the cell, random colours."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for cell in rng.sample(range(9), count):
        side = rng.randint(14, 22)
        x = CELL * (cell % 3) + rng.randint(1, CELL - side - 1)
        y = CELL * (cell // 3) + rng.randint(1, CELL - side - 1)
        colour = tuple(rng.randint(0, 160) for _ in range(3))
        pen.rectangle([x, y, x + side - 1, y + side - 1], fill=colour)
    return image


def write_split(out: Path, name: str, n: int, seed: int, image_size: int = SIZE) -> list[dict]:
    """``n`` rows and their pictures; ``image_size``: the pictures scaled (nearest pixel) to that many pixels a
    side, for a vision tower of real size (the same squares over more patches)."""
    from PIL import Image

    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        count = rng.randint(1, MAX_COUNT)
        path = out / "images" / f"{name}_{i}.png"
        picture = draw(rng, count)
        if image_size != SIZE:
            picture = picture.resize((image_size, image_size), Image.Resampling.NEAREST)
        picture.save(path)
        rows.append({"prompt": QUESTION, "images": [str(path.resolve())], "label": str(count)})
    with open(out / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--sft", type=int, default=2048)
    parser.add_argument("--eval", type=int, default=128)
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_split(out, "train", args.train, args.seed * 3 + 1)
    write_split(out, "eval", args.eval, 10_000 + args.seed)
    sft = write_split(out, "sft_prompts", args.sft, args.seed * 3 + 2)
    with open(out / "sft.jsonl", "w") as f:
        for row in sft:
            messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["label"]}]
            f.write(json.dumps({"messages": messages, "images": row["images"]}) + "\n")
    print(f"{out}: train {args.train}, eval {args.eval}, sft {args.sft} pictures")


if __name__ == "__main__":
    main()
