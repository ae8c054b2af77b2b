"""The shapes task: the detector scores rendered ground truth correct and wrong captions incorrect,
the dense score orders by how right an image is, hostile input scores 0 without raising, the
grammar parses back, and the split is the documented one. Everything is computed here, on real
renders."""

import hashlib
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rollout_client.rewards.shapes import (
    accuracy_table,
    detect,
    evaluate,
    format_accuracy_table,
    geneval_reward,
    score,
    strict_accuracy,
)
from rollout_core import scenes
from rollout_core.scenes import (
    BACKGROUND,
    HELD_OUT_FOUR,
    HELD_OUT_PAIRS,
    HELD_OUT_RELATIONS,
    PALETTE,
    TASKS,
    Detection,
    ObjectGroup,
    SceneSpec,
    all_specs,
    caption,
    eval_prompts,
    parse_prompt,
    pretraining_specs,
    relation_holds,
    render,
    sample_scene,
    train_prompts,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "training.md"
OPPOSITE = {
    "to the left of": "to the right of",
    "to the right of": "to the left of",
    "above": "below",
    "below": "above",
}


def spec_of(text: str) -> SceneSpec:
    spec = parse_prompt(text)
    assert spec is not None, text
    return spec


def stratified_specs(per_task: int, rng: np.random.Generator) -> list[SceneSpec]:
    """``per_task`` specs of each task, drawn uniformly within the task."""
    chosen = []
    for task in TASKS:
        specs = [spec for spec in all_specs() if spec.task == task]
        chosen += [specs[i] for i in rng.integers(len(specs), size=per_task)]
    return chosen


def jpeg_round_trip(image: Image.Image) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return Image.open(buffer).convert("RGB")


@pytest.mark.parametrize(
    ("size", "degrade"),
    [(64, None), (128, None), (128, jpeg_round_trip)],
    ids=["64px", "128px", "128px-jpeg90"],
)
def test_the_detector_scores_rendered_ground_truth_correct(size, degrade):
    rng = np.random.default_rng(size)
    specs = stratified_specs(100 if degrade is None else 25, rng)
    wrong = []
    for spec in specs:
        image = render(spec, size, rng=rng)
        if degrade is not None:
            image = degrade(image)
        result = evaluate(image, caption(spec))
        assert (result.dense == 1.0) == result.correct
        if not result.correct:
            wrong.append(caption(spec))
    rate = 1 - len(wrong) / len(specs)
    assert rate >= 0.98, f"{rate:.1%} of {len(specs)} scenes at {size} px scored correct; wrong: {wrong[:5]}"


@pytest.mark.parametrize("size", [64, 128])
def test_rendered_scenes_keep_their_sizes_gaps_and_relation_margins(size):
    rng = np.random.default_rng(7)
    for spec in stratified_specs(25, rng):
        image = render(spec, size, rng=rng)
        assert (image.mode, image.size) == ("RGB", (size, size))
        packed = np.asarray(image).astype(np.int32) @ np.array([1 << 16, 1 << 8, 1])
        colors = {(c >> 16, (c >> 8) & 255, c & 255) for c in np.unique(packed).tolist()}
        assert colors <= {BACKGROUND, *(PALETTE[g.color] for g in spec.objects)}
        detections = detect(image)
        assert len(detections) == sum(group.count for group in spec.objects)
        widths = [d.box[2] - d.box[0] for d in detections]
        assert min(widths) >= round(10 / 64 * size)
        assert max(widths) <= round({1: 0.5, 2: 0.375, 3: 0.3125, 4: 0.3125}[len(detections)] * size)
        for i, a in enumerate(detections):
            for b in detections[i + 1 :]:
                gap_x = max(a.box[0], b.box[0]) - min(a.box[2], b.box[2])
                gap_y = max(a.box[1], b.box[1]) - min(a.box[3], b.box[3])
                assert max(gap_x, gap_y) >= round(3 / 64 * size), (caption(spec), a, b)
        if spec.task == "position":
            subject, reference = (
                next(d for d in detections if (d.color, d.shape) == (g.color, g.shape)) for g in spec.objects
            )
            axis, sign = {
                "to the left of": (0, -1),
                "to the right of": (0, 1),
                "above": (1, -1),
                "below": (1, 1),
            }[spec.relation]
            assert sign * (subject.centroid[axis] - reference.centroid[axis]) >= size / 3
            assert relation_holds(subject, reference, spec.relation)


def test_render_and_sample_scene_are_deterministic_for_a_generator_state():
    spec = spec_of("four purple triangles")
    first = render(spec, rng=np.random.default_rng(3)).tobytes()
    assert render(spec, rng=np.random.default_rng(3)).tobytes() == first
    assert render(spec, rng=np.random.default_rng(4)).tobytes() != first
    specs = pretraining_specs()
    image, text = sample_scene(specs, np.random.default_rng(5))
    again, same_text = sample_scene(specs, np.random.default_rng(5))
    assert (image.tobytes(), text) == (again.tobytes(), same_text)
    assert spec_of(text) in specs and evaluate(image, text).correct


def test_wrong_captions_score_incorrect_and_the_dense_score_orders_them():
    rng = np.random.default_rng(11)
    circle = render(spec_of("a red circle"), rng=rng)
    three = render(spec_of("three green squares"), rng=rng)
    left = render(spec_of("a red circle to the left of a blue square"), rng=rng)
    pair = render(spec_of("a red circle and a blue square"), rng=rng)

    cases = {  # image, caption: expected dense score (module formula), 1.0 only when correct
        "right": (three, "three green squares", 1.0),
        "one more than asked": (three, "two green squares", 2 / 3),
        "one fewer than asked": (three, "four green squares", 3 / 4),
        "swapped relation": (left, "a red circle to the right of a blue square", 2 / 3),
        "extra object": (pair, "a red circle", 1 / 2),
        "one of two objects": (circle, "a red circle and a blue square", 1 / 2),
        "wrong colour": (circle, "a blue circle", 0.0),
        "wrong shape": (circle, "a red square", 0.0),
    }
    for name, (image, text, expected) in cases.items():
        result = evaluate(image, text)
        assert result.correct == (expected == 1.0), name
        assert result.dense == pytest.approx(expected), name
    assert evaluate(left, "a blue square to the right of a red circle").correct  # the other phrasing
    dense = {name: evaluate(image, text).dense for name, (image, text, _) in cases.items()}
    assert (
        dense["right"] > dense["one fewer than asked"] > dense["one more than asked"] > dense["wrong colour"]
    )


def canvas(size: int = 64) -> np.ndarray:
    pixels = np.empty((size, size, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    return pixels


def test_components_connect_diagonally_and_respect_the_cutoff_and_minimum_area():
    pixels = canvas()
    red = np.array(PALETTE["red"])
    pixels[2:12, 2:12] = red
    pixels[12:22, 12:22] = red  # touches the first at a corner only: one component
    pixels[2:12, 40:50] = red
    pixels[2:12, 51:61] = red  # a pixel apart from its neighbour: two squares
    pixels[40:50, 2:12] = red + (0, 69, 0)  # just within the cut-off (70) of red
    pixels[40:50, 40:50] = red + (0, 71, 0)  # just outside it: no colour
    pixels[30:34, 30:34] = red  # 16 px, under 0.5 % of 4096: ignored
    found = sorted((d.box, d.area, d.shape) for d in detect(Image.fromarray(pixels)))
    assert found == [
        ((2, 2, 22, 22), 200, None),
        ((2, 40, 12, 50), 100, "square"),
        ((40, 2, 50, 12), 100, "square"),
        ((51, 2, 61, 12), 100, "square"),
    ]
    assert all(d.color == "red" for d in detect(Image.fromarray(pixels)))


def flood_fill_components(colors: np.ndarray) -> list[tuple[int, list[tuple[int, int]]]]:
    """8-connected components of equal non-negative values, one pixel at a time."""
    height, width = colors.shape
    seen = np.zeros_like(colors, dtype=bool)
    components = []
    for y0, x0 in zip(*np.nonzero(colors >= 0), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        stack, pixels = [(y0, x0)], []
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny in range(max(y - 1, 0), min(y + 2, height)):
                for nx in range(max(x - 1, 0), min(x + 2, width)):
                    if not seen[ny, nx] and colors[ny, nx] == colors[y0, x0]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
        components.append((int(colors[y0, x0]), pixels))
    return components


def test_components_match_a_flood_fill_on_random_images():
    rng = np.random.default_rng(9)
    names = list(PALETTE)
    for _ in range(10):
        colors = np.where(rng.random((48, 48)) < 0.55, rng.integers(0, 3, (48, 48)), -1)
        pixels = canvas(48)
        for index in range(3):
            pixels[colors == index] = PALETTE[names[index]]
        expected = sorted(
            (names[color], len(member), min(x for _, x in member), min(y for y, _ in member))
            for color, member in flood_fill_components(colors)
            if len(member) >= 0.005 * 48 * 48
        )
        got = sorted((d.color, d.area, d.box[0], d.box[1]) for d in detect(Image.fromarray(pixels)))
        assert got == expected


def test_shapes_are_told_by_their_best_matching_mask():
    pixels = canvas()
    yy, xx = np.mgrid[:64, :64] + 0.5
    pixels[(xx - 16) ** 2 + (yy - 16) ** 2 <= 10**2] = PALETTE["green"]
    pixels[(np.abs(xx - 48) <= (yy - 6) / 2) & (yy <= 26)] = PALETTE["blue"]  # apex up, 20 px
    pixels[40:60, 4:12] = PALETTE["yellow"]  # 8 x 20: no shape of the grammar
    pixels[40:60, 40:60] = PALETTE["purple"]
    pixels[49:51, 40:60] = BACKGROUND  # a square with a slit: two 20 x 9 bars, no shape
    found = {(d.color, d.shape) for d in detect(Image.fromarray(pixels))}
    assert found == {("green", "circle"), ("blue", "triangle"), ("yellow", None), ("purple", None)}


def box_at(x: float, y: float, color="red", shape="square", side=10) -> Detection:
    return Detection(
        color,
        shape,
        side * side,
        (int(x - side / 2), int(y - side / 2), int(x + side / 2), int(y + side / 2)),
        (x, y),
    )


def test_relations_follow_genevals_rule():
    reference = box_at(50, 50)
    # Offset (-30, 0): shrunk by 0.1 * (10 + 10) = 2 on each axis, -28 / 30 < -0.5: left only.
    assert [r for r in OPPOSITE if relation_holds(box_at(20, 50), reference, r)] == ["to the left of"]
    # Offset (-20, -20): 18 / 28.3 = 0.64 on both axes: left and above.
    assert [r for r in OPPOSITE if relation_holds(box_at(30, 30), reference, r)] == [
        "to the left of",
        "above",
    ]
    # Offset (-20, -40): x 18 / 44.7 = 0.40, y 38 / 44.7 = 0.85: above only.
    assert [r for r in OPPOSITE if relation_holds(box_at(30, 10), reference, r)] == ["above"]
    # Offset (0, 3): shrunk to 1 of 3, under half: no relation, nor for coincident centroids.
    assert not any(relation_holds(box_at(50, 53), reference, r) for r in OPPOSITE)
    assert not any(relation_holds(box_at(50, 50), reference, r) for r in OPPOSITE)


def test_dense_score_formula_on_given_detections():
    four = spec_of("four blue triangles")
    triangles = [box_at(10 + 15 * i, 10, "blue", "triangle") for i in range(3)]
    assert score(four, triangles).dense == pytest.approx(3 / 4)
    assert score(four, [*triangles, box_at(60, 60, "blue", None)]).dense == pytest.approx(3 / 4 / 2)
    assert score(four, [*triangles, box_at(60, 60, "blue", "triangle")]).correct
    position = spec_of("a yellow circle below a green square")
    below = [box_at(30, 50, "yellow", "circle"), box_at(30, 10, "green", "square")]
    assert score(position, below).correct
    # Two yellow circles: count 1/2, the largest (the first here) still below: (1/2 + 1 + 1) / 3.
    doubled = [box_at(30, 50, "yellow", "circle", side=12), *below]
    assert score(position, doubled).dense == pytest.approx(2.5 / 3) and not score(position, doubled).correct
    assert score(position, below[:1]).dense == pytest.approx(1 / 3)


def hostile_images() -> dict[str, object]:
    rng = np.random.default_rng(0)
    scene = render(spec_of("a red circle"), rng=rng)
    png = io.BytesIO()
    scene.save(png, format="PNG")
    return {
        "blank": Image.new("RGB", (64, 64), BACKGROUND),
        "black": Image.new("RGB", (64, 64)),
        "uniform noise": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)),
        "large noise": Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)),
        "1x1": Image.new("RGB", (1, 1), PALETTE["red"]),
        "7x300": scene.resize((7, 300)),
        "too large": scene.resize((600, 600)),
        "grayscale": scene.convert("L"),
        "RGBA": scene.convert("RGBA"),
        "palette mode": scene.convert("P"),
        "truncated PNG": Image.open(io.BytesIO(png.getvalue()[: len(png.getvalue()) // 2])),
        "not an image": np.asarray(scene),
        "None": None,
    }


def test_hostile_inputs_score_zero_without_raising():
    rng = np.random.default_rng(1)
    scene = render(spec_of("a red circle"), rng=rng)
    for name, image in hostile_images().items():
        result = evaluate(image, "a red circle")
        assert (result.correct, result.dense) == (False, 0.0), name
    prompts = [
        "a red circle " * 800,
        "a red circle" + " " * 9000,
        "A red circle",
        "a red circle.",
        " a red circle",
        "",
    ]
    prompts += ["a (red|blue)+ circle" * 20, "a red circle and a red circle", "five red circles", None, 3]
    for prompt in prompts:
        assert parse_prompt(prompt) is None, prompt
        assert evaluate(scene, prompt).dense == 0.0
    images = list(hostile_images().values())
    rewards = geneval_reward(images, ["a red circle"] * len(images))
    assert rewards.dtype == torch.float32 and rewards.tolist() == [0.0] * len(images)
    with pytest.raises(ValueError, match="RGB images of 32 to 512"):
        detect(hostile_images()["RGBA"])


def test_rewards_are_float32_per_image_and_load_by_name():
    rng = np.random.default_rng(2)
    prompts = ["two yellow circles", "a purple square above a red triangle", "a green circle"]
    images = [render(spec_of(p), rng=rng) for p in prompts]
    prompts[2] = "a green square"
    dense = geneval_reward(images, prompts)
    strict = strict_accuracy(images, prompts)
    assert dense.dtype == strict.dtype == torch.float32 and dense.shape == strict.shape == (3,)
    assert dense.tolist() == [1.0, 1.0, 0.0] and strict.tolist() == [1.0, 1.0, 0.0]
    module, _, name = "rollout_client.rewards.shapes:geneval_reward".partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is geneval_reward
    with pytest.raises(ValueError):
        geneval_reward(images, prompts[:2])


def test_accuracy_table_counts_per_task_and_overall():
    prompts = ["a red circle", "two red circles", "three red circles", "a red circle and a blue square"]
    table = accuracy_table(prompts, [True, True, False, torch.tensor(0.0)])
    assert table == {
        "single": (1, 1),
        "counting": (1, 2),
        "two_objects": (0, 1),
        "position": (0, 0),
        "overall": (2, 4),
    }
    printed = format_accuracy_table(table)
    assert "| counting | 1 / 2 | 50.0 % |" in printed and "| position | 0 / 0 | - |" in printed
    with pytest.raises(ValueError, match="not a prompt"):
        accuracy_table(["a red fox"], [True])


def test_every_caption_parses_back_to_its_spec():
    specs = all_specs()
    counts = {task: sum(spec.task == task for spec in specs) for task in TASKS}
    assert counts == {"single": 15, "counting": 45, "two_objects": 210, "position": 840}
    captions = [caption(spec) for spec in specs]
    assert len(set(captions)) == len(specs)
    assert all(parse_prompt(text) == spec for text, spec in zip(captions, specs, strict=True))
    assert caption(SceneSpec("counting", (ObjectGroup("red", "circle", 2),))) == "two red circles"
    assert caption(
        SceneSpec("position", (ObjectGroup("blue", "square"), ObjectGroup("blue", "circle")), "above")
    ) == ("a blue square above a blue circle")
    for pattern in (
        r"a (red|green|blue|yellow|purple) (circle|square|triangle)",
        r"(two|three|four) (red|green|blue|yellow|purple) (circle|square|triangle)s",
        r"a \w+ \w+ and a \w+ \w+",
        r"a \w+ \w+ (to the left of|to the right of|above|below) a \w+ \w+",
    ):
        assert any(re.fullmatch(pattern, text) for text in captions), pattern
    for invalid in (
        lambda: SceneSpec("two_objects", (ObjectGroup("red", "circle"), ObjectGroup("red", "circle"))),
        lambda: SceneSpec("position", (ObjectGroup("red", "circle"), ObjectGroup("red", "square"))),
        lambda: SceneSpec("counting", (ObjectGroup("red", "circle", 1),)),
        lambda: SceneSpec("single", (ObjectGroup("red", "circle"),), "above"),
        lambda: ObjectGroup("orange", "circle"),
    ):
        with pytest.raises(ValueError):
            invalid()


def documented_held_out(spec: SceneSpec) -> bool:
    """The split's rule restated: the tables name compositions, either phrasing of a scene counts."""
    objects = [(group.color, group.shape) for group in spec.objects]
    if spec.task == "counting":
        return spec.objects[0].count == 4 and objects[0] in HELD_OUT_FOUR
    if spec.task == "two_objects":
        return tuple(objects) in HELD_OUT_PAIRS or tuple(reversed(objects)) in HELD_OUT_PAIRS
    if spec.task == "position":
        return (objects[0], spec.relation) in HELD_OUT_RELATIONS or (
            objects[1],
            OPPOSITE[spec.relation],
        ) in HELD_OUT_RELATIONS
    return False


def scene_of(text: str) -> tuple:
    """A scene independent of its phrasing."""
    spec = spec_of(text)
    objects = [(group.color, group.shape, group.count) for group in spec.objects]
    if spec.task == "position":
        return ("position", frozenset({(*objects[0], spec.relation), (*objects[1], OPPOSITE[spec.relation])}))
    return (spec.task, frozenset(objects))


def test_pretraining_excludes_exactly_the_held_out_scenes():
    held_out = {spec for spec in all_specs() if documented_held_out(spec)}
    assert set(pretraining_specs()) == set(all_specs()) - held_out
    assert {task: sum(s.task == task for s in held_out) for task in TASKS} == {
        "single": 0,
        "counting": 6,
        "two_objects": 24,
        "position": 134,
    }
    assert all(scenes.is_held_out(spec) == (spec in held_out) for spec in all_specs())
    # Pretraining still shows every colour-shape pair in every task, and every relation.
    for task in TASKS:
        seen = {(g.color, g.shape) for spec in pretraining_specs() if spec.task == task for g in spec.objects}
        assert len(seen) == 15, task
    assert {spec.relation for spec in pretraining_specs() if spec.task == "position"} == set(OPPOSITE)


def test_rl_prompt_sets_are_disjoint_by_scene_and_cover_every_task():
    evaluation, training = eval_prompts(), train_prompts()
    assert len(set(evaluation)) == len(evaluation) == 64 and len(set(training)) == len(training) == 164
    assert not {scene_of(t) for t in evaluation} & {scene_of(t) for t in training}
    for prompts, sizes, held in (
        (evaluation, (8, 16, 20, 20), (0, 3, 6, 10)),
        (training, (7, 29, 64, 64), (0, 3, 6, 32)),
    ):
        specs = [spec_of(text) for text in prompts]
        assert tuple(sum(s.task == task for s in specs) for task in TASKS) == sizes
        assert tuple(sum(s.task == task and documented_held_out(s) for s in specs) for task in TASKS) == held
        assert len({scene_of(t) for t in prompts}) == len(prompts)  # one phrasing per scene
    # The sets are fixed: a change to them changes every accuracy reported on them.
    digest = hashlib.sha256("\n".join(evaluation + ("",) + training).encode()).hexdigest()
    assert digest == PINNED_PROMPT_SETS_SHA256


PINNED_PROMPT_SETS_SHA256 = "ff537a2dddfdbd9ece0c130b2e8d29f8f4316d2d8708b0bf637a7c34b614f70a"


def documented_section(title: str) -> str:
    """The text of docs/training.md's subsection ``title`` of "The shapes task"."""
    text = DOCS.read_text()
    text = text[text.index("## The shapes task") :]
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start : end if end >= 0 else None]


def test_the_docs_list_the_palette_and_the_held_out_compositions():
    rows = re.findall(
        r"^\| (\w+) \| \((\d+), (\d+), (\d+)\) \|$", documented_section("Scenes"), flags=re.MULTILINE
    )
    assert {name: tuple(map(int, rgb)) for name, *rgb in rows} == {**PALETTE, "background": BACKGROUND}
    split = documented_section("The split")
    counting, pairs, relations = (
        re.search(rf"^\| `{task}` \| (.+) \| \d+ \|$", split, flags=re.MULTILINE).group(1)
        for task in ("counting", "two_objects", "position")
    )
    assert counting == "four of: " + ", ".join(f"{c} {s}" for c, s in HELD_OUT_FOUR)
    assert pairs == ", ".join(f"{a} {b} + {c} {d}" for (a, b), (c, d) in HELD_OUT_PAIRS)
    assert relations == ", ".join(f"{c} {s} {r}" for (c, s), r in HELD_OUT_RELATIONS) + " (the other object)"
