r"""The shapes task's scenes: a procedural dataset, its caption grammar and split, and the geometry of
relations; ``rollout_client.rewards.shapes`` scores an image against its prompt.

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

**Relations** (``relation_holds``) follow GenEval: with offset = the subject's centroid minus the
reference's (x to the right, y down) and each axis's offset shrunk towards 0 by 0.1 times the sum
of the two boxes' extents along it, the relation holds when the shrunk offset along its axis, in
its direction, exceeds half the length of the unshrunk offset.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
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


MIN_SIDE, MAX_SIDE = 32, 512  # rendered and detected images, pixels per side
MAX_PROMPT_CHARS = 200  # longer than any caption of the grammar


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


def group_pair(group: ObjectGroup) -> tuple[str, str]:
    """The (colour, shape) pair of a group: what a detection matches it by."""
    return (group.color, group.shape)


def _scene_key(spec: SceneSpec) -> tuple:
    """Equal for the phrasings of one scene: each object with the relation it stands in to the other."""
    if spec.task == "two_objects":
        return (spec.task, frozenset(map(group_pair, spec.objects)))
    if spec.task == "position":
        first, second = map(group_pair, spec.objects)
        return (spec.task, frozenset({(first, spec.relation), (second, INVERSE_RELATION[spec.relation])}))
    return (spec.task, spec.objects)


def is_held_out(spec: SceneSpec) -> bool:
    """Whether ``spec``'s scene is held out of pretraining (module docstring, Split)."""
    if spec.task == "counting":
        return spec.objects[0].count == 4 and group_pair(spec.objects[0]) in HELD_OUT_FOUR
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


def shape_mask(shape: str, width: int, height: int) -> np.ndarray:
    """``shape`` drawn to fill a ``width`` x ``height`` box, as a boolean mask sampled at pixel centres."""
    u = ((np.arange(width) + 0.5) / width * 2 - 1)[None, :]  # -1 at the left edge, 1 at the right
    v = ((np.arange(height) + 0.5) / height * 2 - 1)[:, None]  # -1 at the top, 1 at the bottom
    if shape == "circle":
        return u**2 + v**2 <= 1
    if shape == "triangle":  # apex at the top centre, base along the bottom
        return np.abs(u) <= (v + 1) / 2
    return np.ones((height, width), dtype=bool)


def measure(color: str, shape: str | None, ys: np.ndarray, xs: np.ndarray) -> Detection:
    """The Detection of the pixels at ``ys``, ``xs``: area, bounding box and centroid."""
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
                (group, x, y, shape_mask(group.shape, side, side))
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
    return measure(group.color, group.shape, ys + y, xs + x)


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
