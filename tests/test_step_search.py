"""Rewards on previews and step-wise search, through the shared shapes server (the pretrained preset,
whose previews the shapes reward can read): each node's intermediate reward is its own preview's, and
the search keeps the argmax of its candidates' preview rewards, prunes the others at the next step,
counts the transformer rows the server reports, and with K = 1 is plain sampling bitwise.

Rewards are compared exactly: the test scores the same PNG bytes with the same reward functions, one
image at a time, and each term reads one image alone (no batch enters its value)."""

import io
import json

import pytest
import torch
from PIL import Image as PILImage
from support.families import family_request
from support.requests import collected

from rollout.v1 import rollout_pb2
from rollout_client import Preview, Step
from rollout_client.cli import main
from rollout_client.events import Finished, Pruned
from rollout_client.preview_rewards import score_previews
from rollout_client.rewards import jpeg_compressibility
from rollout_client.rewards.shapes import geneval_reward
from rollout_client.search import step_search
from rollout_client.train.rewards import Rewards

FAMILY = "shapes"
# The trainer's composition of two terms: the GenEval-style score, which an early preview often leaves
# at 0 for every candidate, and the JPEG term, which tells the candidates apart.
REWARD = "rollout_client.rewards.shapes:geneval_reward,rollout_client.rewards:jpeg_compressibility*0.1"
STEPS = 6


def composed(png: bytes, prompt: str) -> float:
    """REWARD of one image, written out: geneval + 0.1 jpeg."""
    image = PILImage.open(io.BytesIO(png))
    return float(geneval_reward([image], [prompt])[0] + 0.1 * jpeg_compressibility([image], [prompt])[0])


class CountingReward(Rewards):
    """REWARD, recording how many images each call scored."""

    def __init__(self):
        super().__init__(REWARD)
        self.calls: list[int] = []

    def __call__(self, images, prompts, metadata=None):
        self.calls.append(len(images))
        return super().__call__(images, prompts, metadata)


@pytest.fixture(scope="module")
def shapes_client(family_resources):
    return family_resources.client(FAMILY)


def request(**fields) -> rollout_pb2.RolloutRequest:
    """The family's two prompts, one sample each, over STEPS flow-SDE steps at 64 x 64 with images, at
    the preset's CFG (true CFG 3: two branches a step)."""
    fields = {"samples_per_prompt": 1, "num_steps": STEPS, "images": True, **fields}
    return family_request(FAMILY, "FLOW_SDE", cfg=True, **fields)


def test_each_node_is_rewarded_on_its_own_preview_once_per_distinct_state(shapes_client):
    branches = [rollout_pb2.Branch(step=1, factor=2), rollout_pb2.Branch(step=3, factor=3)]
    events = list(shapes_client.stream(request(branches=branches, preview_steps=[1, 2, 3, 5])))
    collector = collected(events)
    reward = CountingReward()
    scored = score_previews(collector, reward)
    tree, prompts = collector.tree, collector.started.message.resolved.prompts
    assert sorted(scored) == [1, 2, 3, 5]
    for step, by_node in scored.items():
        assert sorted(by_node) == sorted(collector.previews[step])
        for node, value in by_node.items():
            assert value == composed(collector.previews[step][node][0], prompts[tree[node].prompt_index])
    # One image per distinct x_i: at branch steps 1 and 3 the children share their parent's preview.
    assert reward.calls == [2, 4, 4, 12]  # steps 1, 2, 3, 5: roots, depth 1 (twice), leaves
    for node in tree.nodes:
        if node.depth == 1:
            assert scored[1][node.id] == scored[1][tree.nodes[node.parent].children[0]]
    # Each leaf carries the rewards of its own path's previews, and a second call scores nothing more.
    for leaf in collector.trajectories():
        for step in (1, 2, 3, 5):
            took = next(n.id for n in tree.path(leaf.sample_index) if n.start_step <= step < n.end_step)
            assert leaf.step_rewards[step] == scored[step][took]
            assert leaf.step_rewards[step] == composed(leaf.previews[step][0], leaf.prompt)
    score_previews(collector, reward)
    assert len(reward.calls) == 4


def test_a_flat_rollouts_samples_are_rewarded_on_their_previews(shapes_client):
    events = list(shapes_client.stream(request(samples_per_prompt=2, preview_steps=[2])))
    collector = collected(events)
    scored = score_previews(collector, geneval_reward)[2]
    for trajectory in collector.trajectories():
        image = trajectory.preview(2)
        assert scored[trajectory.sample_index] == trajectory.step_rewards[2]
        assert trajectory.step_rewards[2] == geneval_reward([image], [trajectory.prompt]).item()
    with pytest.raises(ValueError, match="previews of step 3"):
        score_previews(collector, geneval_reward, [3])


def test_search_keeps_the_best_preview_at_each_step_and_prunes_the_others_at_the_next(shapes_client):
    k, steps = 3, [0, 2, 4]  # decided at the previews of steps 1 and 3; step 4's children at the end
    result = step_search(shapes_client, request(), Rewards(REWARD), k, steps)
    events, tree = result.events, result.collector.tree
    prompts = result.collector.started.message.resolved.prompts
    previews: dict[tuple[int, int], bytes] = {}  # (step, node that took it) -> first frame
    for event in events:
        if isinstance(event, Preview) and event.media.frame_index == 0:
            previews[event.step, event.sample_index] = event.media.png
    pruned_events = [event for event in events if isinstance(event, Pruned)]
    assert len(pruned_events) == 2
    decided = [d for d in result.decisions if d.step < STEPS]
    assert [(d.step, d.sample) for d in decided] == [(1, 0), (1, 1), (3, 0), (3, 1)]
    kept_path = {0: [0], 1: [1]}
    for decision in decided:
        # The candidates are the K children of the path kept so far, each scored on its own x0_hat at
        # the step after its branch (on its children's rows, which carry its state, where that step
        # branches too).
        (parent,) = {tree[node].parent for node in decision.candidates}
        assert parent == kept_path[decision.sample][-1]
        assert list(decision.candidates) == list(tree[parent].children)
        expected = []
        for node in decision.candidates:
            row = node if tree[node].end_step > decision.step else tree[node].children[0]
            expected.append(composed(previews[decision.step, row], prompts[tree[node].prompt_index]))
        assert list(decision.rewards) == expected
        best = max(expected)
        assert decision.kept == decision.candidates[expected.index(best)]  # the first of ties
        kept_path[decision.sample].append(decision.kept)
        # The others stop at the next step: a pruned event says so, and no later step has their rows.
        losers = set(decision.candidates) - {decision.kept}
        (event,) = [e for e in pruned_events if losers <= set(e.nodes)]
        assert event.step == decision.step + 1
        stopped = {n.id for loser in losers for n in tree.descendants(loser)}
        later = [e for e in events if isinstance(e, Step) and e.index > decision.step]
        assert not any(stopped & set(e.nodes) for e in later)
    # Step 4's three children all finish: the best final image is kept.
    for sample, final in [(d.sample, d) for d in result.decisions if d.step == STEPS]:
        assert [tree[n].parent for n in final.candidates] == [kept_path[sample][-1]] * k
        (kept,) = [t for t in result.trajectories if t.node_path[0] == sample]
        assert kept.sample_index == final.kept
        assert kept.node_path[1:-1] == kept_path[sample][1:]
    # The forwards: per sample, one row a step plus K - 1 more at each of steps 1, 3 and 5 (the
    # children of steps 0, 2 and 4 each take one step of their own), times 2 CFG branches.
    finished = next(event for event in events if isinstance(event, Finished))
    assert result.forwards == finished.message.transformer_rows == 2 * 2 * (STEPS + 3 * (k - 1))
    assert result.plain_forwards == 2 * 2 * STEPS


def test_a_search_of_one_is_plain_sampling_bitwise(shapes_client):
    """Same path (docs/testing.md): a tree whose factors are 1 is the flat rollout, previews decode
    beside the steps and the holds change no row, on the same server alone, in the same order."""
    plain = shapes_client.rollout(request())
    result = step_search(shapes_client, request(), Rewards(REWARD), 1, [0, 2, 4])
    assert [d.kept for d in result.decisions] == [0, 1, 0, 1]  # each sample's one candidate
    assert len(plain) == len(result.trajectories) == 2
    for searched, sampled in zip(result.trajectories, plain, strict=True):
        assert searched.image_png == sampled.image_png
        assert torch.equal(searched.latents[-1], sampled.latents[-1])
    assert result.forwards == result.plain_forwards == 2 * 2 * STEPS


def test_the_command_line_searches_and_reports_the_forwards(shapes_client, tmp_path, capsys):
    out = tmp_path / "searched"
    args = ["rollout", "--address", shapes_client.address, "a red circle", "--steps", str(STEPS)]
    args += ["--height", "64", "--width", "64", "--sampler", "flow-sde", "--search", "2"]
    assert main([*args, "--search-steps", "1,3", "--reward", REWARD, "--out", str(out)]) == 0
    document = json.loads((out / "rollout.json").read_text())
    search = document["search"]
    assert search["k"] == 2 and search["steps"] == [1, 3]
    assert search["forwards"] == document["finished"]["transformer_rows"]
    cfg_branches = 2  # the preset's true CFG
    assert search["plain_forwards"] == STEPS * cfg_branches
    assert search["forwards"] == (STEPS + 2) * cfg_branches
    (sample,) = document["samples"]
    assert sample["index"] == search["kept"][0]
    assert (out / f"sample-{sample['index']}.png").exists()
    assert f"search: {search['forwards']} transformer forwards, plain sampling" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags", [["--search", "2"], ["--reward", REWARD], ["--search", "0", "--reward", REWARD]]
)
def test_search_flags_go_together(flags, capsys):
    with pytest.raises(SystemExit):
        main(["rollout", "a red circle", "--out", "unused", *flags])
    assert "--search" in capsys.readouterr().err
