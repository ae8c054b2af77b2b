r"""The shapes task: a procedural scene dataset, its caption grammar and split, and a GenEval-style
detector that scores an image against its prompt.

**Scenes.** 1 to 4 flat-coloured shapes (``SHAPES``: circle, square, upright isosceles triangle,
each as wide as it is tall) in a colour of ``PALETTE`` on the ``BACKGROUND`` colour. At size S each
shape's side is drawn from [10 S / 64, m S] with m = 0.5 for one shape, 0.375 for two and 0.3125 for
three or four; shapes lie wholly inside the image, and their bounding boxes are at least 3 S / 64
pixels apart. Edges are hard (no anti-aliasing). ``render`` is deterministic for a given generator
state.

**Grammar** (``caption`` and ``parse_prompt``; ``all_specs()`` enumerates it, 1110 captions):

* ``single``: ``a {color} {shape}`` (15)
* ``counting``: ``{two|three|four} {color} {shape}s`` (45)
* ``two_objects``: ``a {color} {shape} and a {color} {shape}``, two different colour-shape pairs (210)
* ``position``: ``a {color} {shape} {relation} a {color} {shape}``, two different pairs, the
  relation one of ``RELATIONS``, read as GenEval reads it: the first object relative to the second
  (840). In a rendered position scene the centroids are at least S / 3 apart along the relation's
  axis, and ``relation_holds`` is true.

**Split.** A scene is held out of pretraining when it is one of these compositions, whatever the
phrasing (``a red square to the left of a blue circle`` and ``a blue circle to the right of a red
square`` are one scene):

* ``HELD_OUT_FOUR``: the count four for these colour-shape pairs;
* ``HELD_OUT_PAIRS``: these two colour-shape pairs together in a two-object scene;
* ``HELD_OUT_RELATIONS``: this colour-shape pair in this relation to the other object of a position
  scene.

``pretraining_specs()`` is every other spec, all singles among them.

The RL prompt sets are disjoint by scene, not only by text. Each scene is represented by its
phrasing of lowest SHA-256 (salted with ``SPLIT_SALT``), and the scenes are ranked by that hash. Per
task, ``eval_prompts()`` takes the first ``EVAL_SIZES[task]`` scenes: half of them held out (but at
most half of the task's held-out scenes, so that training meets the others), the rest seen.
``train_prompts()`` takes the next ones, up to ``TRAIN_SIZE`` per task, again half held out as far
as the held-out scenes left allow. Eval prompts are in grammar order, train prompts in hash order
(so consecutive prompts mix the tasks).

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

**Relations** (``relation_holds``) follow GenEval: with offset = the subject's centroid minus the
reference's (x to the right, y down) and each axis's offset shrunk towards 0 by 0.1 times the sum
of the two boxes' extents along it, the relation holds when the shrunk offset along its axis, in
its direction, exceeds half the length of the unshrunk offset.

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

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import pairwise

import numpy as np
import torch
from PIL import Image

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (30, 100, 230),
    "yellow": (240, 200, 30),
    "purple": (140, 30, 160),
}
BACKGROUND = (236, 236, 232)
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}
RELATIONS = ("to the left of", "to the right of", "above", "below")
TASKS = ("single", "counting", "two_objects", "position")

# The relation the second object of a position scene stands in to the first.
INVERSE_RELATION = {
    "to the left of": "to the right of",
    "to the right of": "to the left of",
    "above": "below",
    "below": "above",
}
# Each relation's axis (0: x, to the right; 1: y, down) and the sign of the subject's offset along it.
RELATION_AXES = {"to the left of": (0, -1), "to the right of": (0, 1), "above": (1, -1), "below": (1, 1)}

HELD_OUT_FOUR: tuple[tuple[str, str], ...] = (
    ("red", "circle"),
    ("green", "square"),
    ("blue", "triangle"),
    ("yellow", "circle"),
    ("purple", "square"),
    ("red", "triangle"),
)
HELD_OUT_PAIRS: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = (
    (("red", "circle"), ("blue", "square")),
    (("red", "square"), ("green", "triangle")),
    (("red", "triangle"), ("purple", "circle")),
    (("green", "circle"), ("purple", "circle")),
    (("green", "square"), ("yellow", "triangle")),
    (("blue", "circle"), ("blue", "triangle")),
    (("blue", "triangle"), ("yellow", "triangle")),
    (("yellow", "circle"), ("purple", "square")),
    (("yellow", "square"), ("yellow", "circle")),
    (("purple", "triangle"), ("green", "triangle")),
    (("red", "square"), ("red", "circle")),
    (("blue", "square"), ("purple", "triangle")),
)
HELD_OUT_RELATIONS: tuple[tuple[tuple[str, str], str], ...] = (
    (("red", "square"), "to the left of"),
    (("green", "circle"), "above"),
    (("blue", "triangle"), "to the right of"),
    (("yellow", "square"), "below"),
    (("purple", "circle"), "to the left of"),
)

SPLIT_SALT = "shapes-split-v1"
EVAL_SIZES = {"single": 8, "counting": 16, "two_objects": 20, "position": 20}
TRAIN_SIZE = 64  # per task, at most

MIN_SIDE, MAX_SIDE = 32, 512  # detector input, pixels per side
MAX_PROMPT_CHARS = 200  # longer than any caption of the grammar
# Under half the distance of the closest two palette colours (144.6), so a pixel is within it of one colour
# at most; blends of a colour with the background stay 119 or more from every other colour.
COLOR_CUTOFF = 70
MIN_AREA_FRACTION = 0.005  # a 10 px triangle at 64 px is 1.2 % of the image
ASPECT_RANGE = (0.75, 1.33)  # width / height of a shape's bounding box
MIN_SHAPE_IOU = 0.6  # exact shapes reach 0.92 or more at 64 px, blurred or JPEG-compressed ones 0.67 or more
POSITION_SHRINK = 0.1  # GenEval's position threshold

# Rendering, as fractions of the image side.
MIN_SHAPE_SIDE = 10 / 64
MAX_SHAPE_SIDE = {1: 0.5, 2: 0.375, 3: 0.3125, 4: 0.3125}
GAP = 3 / 64
POSITION_MIN_DISTANCE = 1 / 3
PLACEMENT_TRIES = 100  # positions tried for one shape before the scene starts over
SCENE_TRIES = 1000


@dataclass(frozen=True)
class ObjectGroup:
    """``count`` shapes of one colour and kind."""

    color: str
    shape: str
    count: int = 1

    def __post_init__(self):
        if self.color not in PALETTE or self.shape not in SHAPES or not 1 <= self.count <= 4:
            raise ValueError(f"not an object group of the grammar: {self}")


@dataclass(frozen=True)
class SceneSpec:
    """A caption's meaning. ``position``: ``objects[0]`` stands in ``relation`` to ``objects[1]``."""

    task: str
    objects: tuple[ObjectGroup, ...]
    relation: str | None = None

    def __post_init__(self):
        counts = tuple(group.count for group in self.objects)
        if self.task == "single":
            valid = counts == (1,)
        elif self.task == "counting":
            valid = len(counts) == 1 and counts[0] in COUNT_WORDS
        elif self.task in ("two_objects", "position"):
            valid = counts == (1, 1) and self.objects[0] != self.objects[1]
        else:
            valid = False
        if self.task == "position":
            valid = valid and self.relation in RELATIONS
        else:
            valid = valid and self.relation is None
        if not valid:
            raise ValueError(f"not a scene of the grammar: {self}")


@dataclass(frozen=True)
class Detection:
    """A connected component of one palette colour. ``shape`` is None when its geometry fits none;
    ``box`` is (x0, y0, x1, y1), end exclusive; ``centroid`` is (x, y) in pixels."""

    color: str
    shape: str | None
    area: int
    box: tuple[int, int, int, int]
    centroid: tuple[float, float]


@dataclass(frozen=True)
class ShapesScore:
    """An image against a prompt: GenEval's strict verdict, the dense score in [0, 1], and what the
    detector found."""

    correct: bool
    dense: float
    detections: tuple[Detection, ...] = ()


NO_SCORE = ShapesScore(correct=False, dense=0.0)


def _object_words(group: ObjectGroup) -> str:
    return f"{group.color} {group.shape}"


def caption(spec: SceneSpec) -> str:
    first = spec.objects[0]
    if spec.task == "single":
        return f"a {_object_words(first)}"
    if spec.task == "counting":
        return f"{COUNT_WORDS[first.count]} {_object_words(first)}s"
    joint = "and" if spec.task == "two_objects" else spec.relation
    return f"a {_object_words(first)} {joint} a {_object_words(spec.objects[1])}"


def _objects() -> list[ObjectGroup]:
    return [ObjectGroup(color, shape) for color in PALETTE for shape in SHAPES]


@cache
def all_specs() -> tuple[SceneSpec, ...]:
    """The whole grammar, in a fixed order: task, then first object, (count | relation), second object."""
    objects = _objects()
    specs = [SceneSpec("single", (group,)) for group in objects]
    specs += [
        SceneSpec("counting", (ObjectGroup(group.color, group.shape, count),))
        for group in objects
        for count in COUNT_WORDS
    ]
    specs += [SceneSpec("two_objects", (a, b)) for a in objects for b in objects if a != b]
    specs += [
        SceneSpec("position", (a, b), relation)
        for a in objects
        for relation in RELATIONS
        for b in objects
        if a != b
    ]
    return tuple(specs)


@cache
def _spec_by_caption() -> dict[str, SceneSpec]:
    return {caption(spec): spec for spec in all_specs()}


def parse_prompt(text: object) -> SceneSpec | None:
    """The spec whose caption is exactly ``text``, else None. The grammar is finite, so parsing is a
    lookup among its captions: the exact inverse of ``caption`` by construction."""
    if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
        return None
    return _spec_by_caption().get(text)


def _pair(group: ObjectGroup) -> tuple[str, str]:
    return (group.color, group.shape)


def _scene_key(spec: SceneSpec) -> tuple:
    """Equal for the phrasings of one scene: each object with the relation it stands in to the other."""
    if spec.task == "two_objects":
        return (spec.task, frozenset(map(_pair, spec.objects)))
    if spec.task == "position":
        first, second = map(_pair, spec.objects)
        return (spec.task, frozenset({(first, spec.relation), (second, INVERSE_RELATION[spec.relation])}))
    return (spec.task, spec.objects)


def is_held_out(spec: SceneSpec) -> bool:
    """Whether ``spec``'s scene is held out of pretraining (module docstring, Split)."""
    if spec.task == "counting":
        return spec.objects[0].count == 4 and _pair(spec.objects[0]) in HELD_OUT_FOUR
    if spec.task == "two_objects":
        return _scene_key(spec)[1] in {frozenset(pair) for pair in HELD_OUT_PAIRS}
    if spec.task == "position":
        return bool(_scene_key(spec)[1] & set(HELD_OUT_RELATIONS))
    return False


@cache
def pretraining_specs() -> tuple[SceneSpec, ...]:
    """What the base model is pretrained on: the grammar less the held-out scenes."""
    return tuple(spec for spec in all_specs() if not is_held_out(spec))


def _hash_rank(text: str) -> bytes:
    return hashlib.sha256(f"{SPLIT_SALT}\n{text}".encode()).digest()


@cache
def _prompt_sets() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(eval, train) prompts."""
    scenes: dict[tuple, list[str]] = {}
    for spec in all_specs():
        scenes.setdefault(_scene_key(spec), []).append(caption(spec))
    # Each scene as its phrasing of lowest hash, the scenes in the order of those hashes.
    ranked = sorted((min(texts, key=_hash_rank) for texts in scenes.values()), key=_hash_rank)
    evaluation, training = [], []
    for task in TASKS:
        specs = [spec for spec in map(parse_prompt, ranked) if spec.task == task]
        held = [caption(spec) for spec in specs if is_held_out(spec)]
        seen = [caption(spec) for spec in specs if not is_held_out(spec)]
        size = EVAL_SIZES[task]
        eval_held = min(size // 2, len(held) // 2)
        evaluation += held[:eval_held] + seen[: size - eval_held]
        held, seen = held[eval_held:], seen[size - eval_held :]
        train_held = min(TRAIN_SIZE // 2, len(held))
        training += held[:train_held] + seen[: TRAIN_SIZE - train_held]
    grammar_order = {text: index for index, text in enumerate(map(caption, all_specs()))}
    return tuple(sorted(evaluation, key=grammar_order.get)), tuple(sorted(training, key=_hash_rank))


def eval_prompts() -> tuple[str, ...]:
    """The RL evaluation prompts (module docstring, Split)."""
    return _prompt_sets()[0]


def train_prompts() -> tuple[str, ...]:
    """The RL training prompts, disjoint from ``eval_prompts()`` by scene (module docstring, Split)."""
    return _prompt_sets()[1]


def _shape_mask(shape: str, width: int, height: int) -> np.ndarray:
    """``shape`` drawn to fill a ``width`` x ``height`` box, as a boolean mask sampled at pixel centres."""
    u = ((np.arange(width) + 0.5) / width * 2 - 1)[None, :]  # -1 at the left edge, 1 at the right
    v = ((np.arange(height) + 0.5) / height * 2 - 1)[:, None]  # -1 at the top, 1 at the bottom
    if shape == "circle":
        return u**2 + v**2 <= 1
    if shape == "triangle":  # apex at the top centre, base along the bottom
        return np.abs(u) <= (v + 1) / 2
    return np.ones((height, width), dtype=bool)


def _measure(color: str, shape: str | None, ys: np.ndarray, xs: np.ndarray) -> Detection:
    return Detection(
        color=color,
        shape=shape,
        area=len(xs),
        box=(int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1),
        centroid=(float(xs.mean()) + 0.5, float(ys.mean()) + 0.5),
    )


def relation_holds(subject: Detection, reference: Detection, relation: str) -> bool:
    """GenEval's rule (module docstring, Relations)."""
    offset = np.subtract(subject.centroid, reference.centroid)
    extents = np.add(
        (subject.box[2] - subject.box[0], subject.box[3] - subject.box[1]),
        (reference.box[2] - reference.box[0], reference.box[3] - reference.box[1]),
    )
    length = float(np.hypot(*offset))
    if length == 0:
        return False
    shrunk = np.sign(offset) * np.maximum(np.abs(offset) - POSITION_SHRINK * extents, 0) / length
    axis, sign = RELATION_AXES[relation]
    return bool(sign * shrunk[axis] > 0.5)


def _apart(a: tuple[int, int, int], b: tuple[int, int, int], gap: int) -> bool:
    """Whether the squares (x, y, side) ``a`` and ``b`` are at least ``gap`` pixels apart on an axis."""
    return (
        a[0] + a[2] + gap <= b[0]
        or b[0] + b[2] + gap <= a[0]
        or a[1] + a[2] + gap <= b[1]
        or b[1] + b[2] + gap <= a[1]
    )


def _layout(
    spec: SceneSpec, size: int, rng: np.random.Generator
) -> list[tuple[ObjectGroup, int, int, np.ndarray]]:
    """Each shape to draw: its group, the top-left corner of its square and its mask there."""
    groups = [group for group in spec.objects for _ in range(group.count)]
    low = round(MIN_SHAPE_SIDE * size)
    high = round(MAX_SHAPE_SIDE[len(groups)] * size)
    gap = round(GAP * size)
    for _ in range(SCENE_TRIES):
        squares: list[tuple[int, int, int]] = []
        for _group in groups:
            side = int(rng.integers(low, high + 1))
            for _ in range(PLACEMENT_TRIES):
                x, y = (int(v) for v in rng.integers(0, size - side + 1, size=2))
                if all(_apart((x, y, side), other, gap) for other in squares):
                    squares.append((x, y, side))
                    break
            else:
                break
        else:
            shapes = [
                (group, x, y, _shape_mask(group.shape, side, side))
                for group, (x, y, side) in zip(groups, squares, strict=True)
            ]
            if spec.task != "position" or _clear_relation(
                *(_placed(*shape) for shape in shapes), spec.relation, size
            ):
                return shapes
    raise RuntimeError(f"no layout for {caption(spec)!r} at {size} px in {SCENE_TRIES} tries")


def _placed(group: ObjectGroup, x: int, y: int, mask: np.ndarray) -> Detection:
    """What the detector sees of a shape drawn alone."""
    ys, xs = np.nonzero(mask)
    return _measure(group.color, group.shape, ys + y, xs + x)


def _clear_relation(subject: Detection, reference: Detection, relation: str, size: int) -> bool:
    axis = RELATION_AXES[relation][0]
    distance = abs(subject.centroid[axis] - reference.centroid[axis])
    return distance >= POSITION_MIN_DISTANCE * size and relation_holds(subject, reference, relation)


def render(spec: SceneSpec, size: int = 64, *, rng: np.random.Generator) -> Image.Image:
    """An RGB ``size`` x ``size`` image of ``spec``'s scene (module docstring, Scenes)."""
    if not MIN_SIDE <= size <= MAX_SIDE:
        raise ValueError(f"size must be in [{MIN_SIDE}, {MAX_SIDE}], got {size}")
    pixels = np.empty((size, size, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    for group, x, y, mask in _layout(spec, size, rng):
        pixels[y : y + mask.shape[0], x : x + mask.shape[1]][mask] = PALETTE[group.color]
    return Image.fromarray(pixels)


def sample_scene(
    specs: Sequence[SceneSpec], rng: np.random.Generator, size: int = 64
) -> tuple[Image.Image, str]:
    """A spec drawn uniformly from ``specs``, rendered: (image, caption)."""
    spec = specs[int(rng.integers(len(specs)))]
    return render(spec, size, rng=rng), caption(spec)


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
        template = _shape_mask(shape, width, height)
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
            detections.append(_measure(colors[color], _shape_of(ys, xs), ys, xs))
    return detections


def score(spec: SceneSpec, detections: Sequence[Detection]) -> ShapesScore:
    """Strict and dense scores of ``detections`` against ``spec`` (module docstring, Scores)."""
    found = [[d for d in detections if (d.color, d.shape) == _pair(group)] for group in spec.objects]
    wanted = {_pair(group) for group in spec.objects}
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
