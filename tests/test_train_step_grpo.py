"""``--algorithm step-grpo`` on a real server: the trainer asks for the previews of the tree's branch
steps, scores them with the run's reward as they arrive, and trains every edge with the Step-GRPO
advantage of its own node, recomputed here from the streamed previews; a run reports each preview
step's mean reward in metrics.csv."""

import io
import math

import numpy
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from support.parity import TOLERANCE
from support.train_runs import run_trainer, trainer_args, training_server
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tqdm import tqdm

from rollout_client import RolloutClient
from rollout_client.grpo import step_grpo_advantages
from rollout_client.rewards import jpeg_compressibility
from rollout_client.train import Trainer
from rollout_client.train.config import parse_args
from rollout_client.train.distributed import Ranks
from rollout_client.train.metrics import step_reward_column

# Three steps; each root forks in 2 at step 1 and each child in 2 at step 2: a root's edge is step 0,
# a child's step 1, a leaf's step 2, and the previews of steps 1 and 2 reward the roots and children.
STEP_GRPO = ("--algorithm", "step-grpo", "--tree", "1:2,2:2", "--group-size", "2")


@pytest.fixture(scope="module")
def step_client(cache_dir, tiny_flux_folder, tmp_path_factory):
    server = training_server(cache_dir, tmp_path_factory.mktemp("step-grpo") / "server.log")
    try:
        with RolloutClient(server.address, timeout=120) as client:
            yield client
    finally:
        server.stop()


def test_each_edge_trains_with_its_nodes_step_advantage_from_the_streamed_previews(
    step_client, tiny_flux_folder, tmp_path
):
    """One iteration as ``Trainer.train_step`` composes it: the rollout streams with the algorithm's
    ``on_step``, which has scored both preview steps by the time the stream ends; the advantages the
    update trains with are ``step_grpo_advantages`` of the previews' rewards recomputed here from the
    streamed PNGs (the same reward on the same bytes, then the same float64 arithmetic: equal bitwise),
    and the edges train on policy."""
    config = parse_args(trainer_args(step_client.address, str(tmp_path), *STEP_GRPO, "--iterations", "1"))
    with torch.random.fork_rng(devices=[]):
        trainer = Trainer(config, step_client, tiny_flux_folder, Ranks())
    rollout, _, _ = trainer.roll_out(0, tqdm(disable=True), None)
    collector = rollout.collector
    assert sorted(collector.previewed) == [1, 2]
    assert sorted(collector.step_rewards) == [1, 2]  # scored as they arrived, before the update

    leaves = rollout.trajectories
    rewards = trainer.reward([leaf.image() for leaf in leaves], [leaf.prompt for leaf in leaves])
    trainer.algorithm.update(rollout, rewards, 0)

    prompts = collector.started.message.resolved.prompts
    tree = collector.tree
    recomputed = {}
    for step, by_node in collector.previews.items():
        nodes = sorted(by_node)
        images = [Image.open(io.BytesIO(by_node[node][0])) for node in nodes]
        values = jpeg_compressibility(images, [prompts[tree[node].prompt_index] for node in nodes])
        recomputed[step] = dict(
            zip(nodes, torch.as_tensor(values, dtype=torch.float64).tolist(), strict=True)
        )
    leaf_rewards = dict(zip([leaf.sample_index for leaf in leaves], rewards.tolist(), strict=True))
    expected = step_grpo_advantages(tree, recomputed, leaf_rewards)
    assert torch.equal(
        trainer.algorithm.node_advantages,
        expected,
    )
    # Every node with a transition of its own has an advantage, and its siblings differ from it.
    assert not expected.isnan().any() and expected.abs().max() > 0
    assert trainer.algorithm.ratio_max_dev <= TOLERANCE


def test_a_step_grpo_run_trains_and_reports_each_preview_steps_reward(step_client, tmp_path):
    """Two iterations from the command line: on policy, the adapter moves, and metrics.csv and
    TensorBoard have the mean preview reward of each branch step beside the final images'
    (``reward_mean``)."""
    flags = (*STEP_GRPO, "--iterations", "2", "--report-to", "tensorboard")
    rows = run_trainer(step_client.address, tmp_path / "run", *flags)
    assert len(rows) == 2
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    for row in rows:
        assert float(row["ratio_max_dev"]) <= TOLERANCE and math.isfinite(float(row["loss"]))
        assert row["scored_steps"] == "0 1 2"
        assert all(math.isfinite(float(row[step_reward_column(step)])) for step in (1, 2))
    for step in (1, 2):
        # An event holds a float32: the csv's float64 rounded once, so equal to that rounding.
        scalars = board.Scalars(f"train/{step_reward_column(step)}")
        assert [event.value for event in scalars] == [
            float(numpy.float32(row[step_reward_column(step)])) for row in rows
        ]
    adapter = load_file(tmp_path / "run" / "lora" / "adapter_model.safetensors")
    assert any(tensor.abs().max() > 0 for name, tensor in adapter.items() if "lora_B" in name)
