r"""The shapes task's GenEval-style detector and scores: an image against its prompt (the scenes, their
grammar and split are ``rollout_core.scenes``).

**Detector** (``detect``). Each pixel takes the nearest palette colour if it lies within
``COLOR_CUTOFF`` (Euclidean RGB) of it, and no colour otherwise: the background, blends and
anything else. Pixels of one colour that touch (8-neighbourhood) form a component; components of
less than ``MIN_AREA_FRACTION`` of the image's area are ignored. A component's shape comes from its
bounding box: its aspect ratio (width / height) must lie in ``ASPECT_RANGE``; then each of the three
shapes is drawn to fill that box (the box itself, its inscribed ellipse, the upright triangle on its
bottom edge), and the one whose mask has the best intersection over union with the component is its
shape, if that IoU is at least ``MIN_SHAPE_IOU``; otherwise it has no shape. For a square the IoU is
the fill ratio of the box. Images are read at their own size, which must be
``MIN_SIDE`` to ``MAX_SIDE`` pixels on each side, in mode RGB.

**Scores** (``score``, ``evaluate``). The spec asks for object groups (colour, shape, count n). For a
group, found = the detections of its colour and shape. A detection that matches no group is extra.

* strict ``correct`` (GenEval's rule): every group found exactly n times, no extra detection, and
  for position the relation holds between the two objects;
* ``dense`` in [0, 1]: the mean of the terms ``min(found, n) / max(found, n)`` per group (0 when
  none is found) and, for position, a relation term (1 when both objects are found and the relation
  holds between the largest detection of each, else 0), divided by ``1 + extras``.

``dense`` is 1 exactly when ``correct``. An image that cannot be read (not a PIL image, not RGB, a
side outside the bounds) or a prompt outside the grammar scores 0 and incorrect.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
from PIL import Image

from rollout_core.scenes import (
    MAX_SIDE,
    MIN_SIDE,
    PALETTE,
    SHAPES,
    TASKS,
    Detection,
    SceneSpec,
    group_pair,
    measure,
    parse_prompt,
    relation_holds,
    shape_mask,
)

# Under half the distance of the closest two palette colours (144.6), so a pixel is within it of one colour
# at most; blends of a colour with the background stay 119 or more from every other colour.
COLOR_CUTOFF = 70


MIN_AREA_FRACTION = 0.005  # a 10 px triangle at 64 px is 1.2 % of the image


ASPECT_RANGE = (0.75, 1.33)  # width / height of a shape's bounding box


MIN_SHAPE_IOU = 0.6  # exact shapes reach 0.92 or more at 64 px, blurred or JPEG-compressed ones 0.67 or more


@dataclass(frozen=True)
class ShapesScore:
    """An image against a prompt: GenEval's strict verdict, the dense score in [0, 1], and what the
    detector found."""

    correct: bool
    dense: float
    detections: tuple[Detection, ...] = ()


NO_SCORE = ShapesScore(correct=False, dense=0.0)


def _color_index(pixels: np.ndarray) -> np.ndarray:
    """Per pixel, the index of its palette colour in ``PALETTE``'s order, -1 for none."""
    palette = np.array(list(PALETTE.values()), dtype=np.int32)
    distances = ((pixels[:, :, None, :].astype(np.int32) - palette) ** 2).sum(axis=-1)
    nearest = distances.argmin(axis=-1)
    within = np.take_along_axis(distances, nearest[..., None], axis=-1)[..., 0] <= COLOR_CUTOFF**2
    return np.where(within, nearest, -1)


def _find(parent: list[int], run: int) -> int:
    while parent[run] != run:
        parent[run] = parent[parent[run]]
        run = parent[run]
    return run


def _components(index: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The 8-connected components of equal non-negative ``index``: (colour index, ys, xs) each, in
    scan order. Runs of a row are joined to the runs of the row above that touch them (union-find)."""
    run_rows, run_starts, run_ends, run_colors = [], [], [], []
    row_runs: list[list[int]] = []  # per row, its runs' ids
    for y, row in enumerate(index):
        starts = np.flatnonzero(np.diff(row, prepend=-2))
        ends = np.append(starts[1:], len(row))
        ids = []
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            if row[start] >= 0:
                ids.append(len(run_rows))
                run_rows.append(y)
                run_starts.append(start)
                run_ends.append(end)
                run_colors.append(int(row[start]))
        row_runs.append(ids)
    parent = list(range(len(run_rows)))
    for above, current in pairwise(row_runs):
        for color in {run_colors[run] for run in current}:
            # Runs of one colour in a row are at least a pixel apart, so a merge walk finds every touch.
            upper = [run for run in above if run_colors[run] == color]
            lower = [run for run in current if run_colors[run] == color]
            i = j = 0
            while i < len(upper) and j < len(lower):
                a, b = upper[i], lower[j]
                if run_starts[a] <= run_ends[b] and run_starts[b] <= run_ends[a]:  # touch, diagonals too
                    root_a, root_b = _find(parent, a), _find(parent, b)
                    parent[max(root_a, root_b)] = min(root_a, root_b)
                if run_ends[a] <= run_ends[b]:
                    i += 1
                else:
                    j += 1
    members: dict[int, list[int]] = {}
    for run in range(len(run_rows)):
        members.setdefault(_find(parent, run), []).append(run)
    components = []
    for runs in members.values():
        xs = np.concatenate([np.arange(run_starts[run], run_ends[run]) for run in runs])
        ys = np.concatenate([np.full(run_ends[run] - run_starts[run], run_rows[run]) for run in runs])
        components.append((run_colors[runs[0]], ys, xs))
    return components


def _shape_of(ys: np.ndarray, xs: np.ndarray) -> str | None:
    """The shape whose mask, drawn in the component's bounding box, overlaps it best (IoU)."""
    x0, y0 = xs.min(), ys.min()
    width, height = int(xs.max() + 1 - x0), int(ys.max() + 1 - y0)
    if not ASPECT_RANGE[0] <= width / height <= ASPECT_RANGE[1]:
        return None
    component = np.zeros((height, width), dtype=bool)
    component[ys - y0, xs - x0] = True
    overlaps = {}
    for shape in SHAPES:
        template = shape_mask(shape, width, height)
        overlaps[shape] = (component & template).sum() / (component | template).sum()
    best = max(overlaps, key=overlaps.get)
    return best if overlaps[best] >= MIN_SHAPE_IOU else None


def _readable(image: object) -> bool:
    return (
        isinstance(image, Image.Image)
        and image.mode == "RGB"
        and MIN_SIDE <= image.width <= MAX_SIDE
        and MIN_SIDE <= image.height <= MAX_SIDE
    )


def detect(image: Image.Image) -> list[Detection]:
    """The palette-coloured components of ``image`` in scan order (module docstring, Detector).
    Raises ValueError for an image the detector does not read."""
    if not _readable(image):
        raise ValueError(
            f"the detector reads RGB images of {MIN_SIDE} to {MAX_SIDE} px a side, got {image!r}"
        )
    index = _color_index(np.asarray(image))
    min_area = MIN_AREA_FRACTION * image.width * image.height
    colors = list(PALETTE)
    detections = []
    for color, ys, xs in _components(index):
        if len(xs) >= min_area:
            detections.append(measure(colors[color], _shape_of(ys, xs), ys, xs))
    return detections


def score(spec: SceneSpec, detections: Sequence[Detection]) -> ShapesScore:
    """Strict and dense scores of ``detections`` against ``spec`` (module docstring, Scores)."""
    found = [[d for d in detections if (d.color, d.shape) == group_pair(group)] for group in spec.objects]
    wanted = {group_pair(group) for group in spec.objects}
    extras = sum((d.color, d.shape) not in wanted for d in detections)
    terms = [min(len(f), g.count) / max(len(f), g.count) for f, g in zip(found, spec.objects, strict=True)]
    counts_right = all(len(f) == g.count for f, g in zip(found, spec.objects, strict=True))
    relation_right = True
    if spec.task == "position":
        largest = [max(f, key=lambda d: d.area) for f in found if f]
        relation_right = len(largest) == 2 and relation_holds(largest[0], largest[1], spec.relation)
        terms.append(float(relation_right))
    return ShapesScore(
        correct=counts_right and extras == 0 and relation_right,
        dense=sum(terms) / len(terms) / (1 + extras),
        detections=tuple(detections),
    )


def evaluate(image: Image.Image, prompt: str) -> ShapesScore:
    """``image`` scored against ``prompt``; 0 and incorrect for an unreadable or undecodable image
    or a prompt outside the grammar."""
    spec = parse_prompt(prompt)
    if spec is None or not _readable(image):
        return NO_SCORE
    try:
        detections = detect(image)
    except OSError:  # PIL decodes lazily: the image data is truncated or corrupt
        return NO_SCORE
    return score(spec, detections)


def geneval_reward(images: Sequence[Image.Image], prompts: Sequence[str]) -> torch.Tensor:
    """The dense score of each image against its prompt: a ``Reward``, float32 [N]."""
    scores = [evaluate(image, prompt).dense for image, prompt in zip(images, prompts, strict=True)]
    return torch.tensor(scores, dtype=torch.float32)


def strict_accuracy(images: Sequence[Image.Image], prompts: Sequence[str]) -> torch.Tensor:
    """1.0 where an image is correct by GenEval's strict rule, else 0.0: float32 [N], its mean the
    accuracy. A ``Reward`` too."""
    scores = [evaluate(image, prompt).correct for image, prompt in zip(images, prompts, strict=True)]
    return torch.tensor(scores, dtype=torch.float32)


def accuracy_table(prompts: Iterable[str], correct: Iterable[bool]) -> dict[str, tuple[int, int]]:
    """(correct, total) per task in ``TASKS`` order, then ``"overall"`` over every prompt. Raises
    ValueError for a prompt outside the grammar."""
    table = dict.fromkeys((*TASKS, "overall"), (0, 0))
    for prompt, right in zip(prompts, correct, strict=True):
        spec = parse_prompt(prompt)
        if spec is None:
            raise ValueError(f"not a prompt of the shapes grammar: {prompt!r}")
        for key in (spec.task, "overall"):
            hits, total = table[key]
            table[key] = (hits + bool(right), total + 1)
    return table


def format_accuracy_table(table: dict[str, tuple[int, int]]) -> str:
    """``accuracy_table``'s result as a Markdown table: task, correct / total, accuracy."""
    lines = ["| task | correct | accuracy |", "|---|---|---|"]
    for task, (hits, total) in table.items():
        accuracy = f"{100 * hits / total:.1f} %" if total else "-"
        lines.append(f"| {task} | {hits} / {total} | {accuracy} |")
    return "\n".join(lines)
