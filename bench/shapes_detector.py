"""The shapes detector on ground truth: rendered scenes scored against their own captions.

For each size, --scenes-per-task scenes of each task are drawn (a spec uniformly from the task's
specs, then rendered, all from one seeded generator) and scored with ``evaluate``, as rendered and
after two degradations a decoder might add: a JPEG round trip at quality 90 (4:2:0 chroma) and a
Gaussian blur of radius 0.8 px. Printed: the strict accuracy per task and overall, per size and
condition.

    python bench/shapes_detector.py                       # 32, 64 and 128 px, 250 scenes per task
    python bench/shapes_detector.py --sizes 64 --scenes-per-task 1000
"""

import argparse
import io

import numpy as np
from PIL import Image, ImageFilter

from rollout_client.rewards.shapes import accuracy_table, evaluate
from rollout_core.scenes import TASKS, all_specs, caption, render


def jpeg(image: Image.Image) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return Image.open(buffer).convert("RGB")


CONDITIONS = {
    "as rendered": lambda image: image,
    "JPEG q90": jpeg,
    "blur 0.8 px": lambda image: image.filter(ImageFilter.GaussianBlur(0.8)),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--scenes-per-task", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    by_task = {task: [spec for spec in all_specs() if spec.task == task] for task in TASKS}
    print(f"| size | condition | {' | '.join(TASKS)} | overall |")
    print(f"|---|---|{'---|' * (len(TASKS) + 1)}")
    for size in args.sizes:
        rng = np.random.default_rng(args.seed)
        specs = [
            by_task[task][int(rng.integers(len(by_task[task])))]
            for task in TASKS
            for _ in range(args.scenes_per_task)
        ]
        images = [render(spec, size, rng=rng) for spec in specs]
        prompts = [caption(spec) for spec in specs]
        for condition, degrade in CONDITIONS.items():
            correct = [
                evaluate(degrade(image), prompt).correct
                for image, prompt in zip(images, prompts, strict=True)
            ]
            table = accuracy_table(prompts, correct)
            cells = " | ".join(f"{100 * hits / total:.1f} %" for hits, total in table.values())
            print(f"| {size} | {condition} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
