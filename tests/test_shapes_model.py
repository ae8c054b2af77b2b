"""The pretrained shapes preset through real servers. It draws the scenes it is asked for often enough
to be a useful base model, and not so often that RL has nothing to lift (GenEval's regime); a
training run on its train prompts evaluates the policy on the eval prompts before and after;
examples/eval_shapes.py prints the GenEval-style table of the policy a LoRA folder holds; and a few
iterations of anchored DiffusionNFT on two prompts raise their dense reward. Replay parity and SP=2
parity are the contract suite's (tests/families/test_contract.py), with the other presets."""

import csv
import json

import pytest
import torch
from PIL import Image
from support.parity import TOLERANCE
from support.servers import example_module, run_example, start_server

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient
from rollout_client.rewards import shapes
from rollout_client.shapes_eval import eval_request, evaluate_policy
from rollout_core import scenes

# The committed model's strict accuracy on the eval prompts, one ODE sample each at EVAL_STEPS, must
# stay in this band (the full 20-step table is in docs/training.md).
BASE_ACCURACY = (0.2, 0.6)
EVAL_STEPS = 10
# The training run evaluates on the first this many eval prompts (single objects and counts).
EVAL_PROMPTS = 16
TRAINING = [
    "--prompt-set", "shapes",
    "--reward", "rollout_client.rewards.shapes:geneval_reward",
    "--iterations", "2", "--prompts", "2", "--group-size", "4", "--steps", "4", "--size", "64",
    "--window", "2", "--eval-every", "2", "--eval-samples", "1", "--eval-prompts", str(EVAL_PROMPTS),
]  # fmt: skip
# Two train prompts the base model draws right only sometimes (a single shape it often draws twice),
# anchored DiffusionNFT's fix of them, and the held fixed rollout that measures the policy before and
# after: the trainer's own rollout shape. Single shapes are what a short run lifts most: each trained
# as long beside one of these, "two red squares" moved by -0.01 and "a red circle and a blue square" by
# +0.00 on the held seeds.
NFT_PROMPTS = ["a purple circle", "a blue circle"]
NFT_TRAINING = [
    *(flag for prompt in NFT_PROMPTS for flag in ("--prompt", prompt)),
    "--reward", "rollout_client.rewards.shapes:geneval_reward",
    "--algorithm", "nft", "--lr", "1e-3", "--nft-loss", "x0", "--nft-anchor", "0.5",
    "--nft-old-decay", "0.5", "--nft-old-ramp", "4",
    "--iterations", "8", "--group-size", "16", "--steps", "8", "--size", "64",
]  # fmt: skip
# The trained policy's velocities at the probe's points stay within this factor of the base model's.
VELOCITY_NORM_BOUND = 1.02  # measured here: at most 1.0091
MEASURE = rollout_pb2.RolloutRequest(
    prompts=NFT_PROMPTS,
    samples_per_prompt=16,
    base_seed=7,
    num_steps=8,
    height=64,
    width=64,
    sampler=rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    noise_level=1.0,
    latents=rollout_pb2.LATENT_SELECTION_NONE,
)


@pytest.fixture(scope="module")
def training_server(cache_dir, family_resources, tmp_path_factory):
    """A shapes server of this module's own: training changes its policy, which the family server
    shared with the replay and SP tests must keep."""
    family_resources.folder("shapes")
    server = start_server(cache_dir, tmp_path_factory.mktemp("shapes") / "server.log", "--model", "shapes")
    try:
        yield server
    finally:
        server.stop()


def run_trainer(server, flags: list[str], out) -> list[dict]:
    """examples/train_grpo.py against ``server``, writing to ``out``: its metrics.csv rows."""
    run_example("train_grpo", "--server", server.address, *flags, "--out", out)
    with open(out / "metrics.csv") as file:
        return list(csv.DictReader(file))


def test_the_base_model_is_right_on_some_scenes_and_wrong_on_others(family_resources):
    result = evaluate_policy(family_resources.client("shapes"), eval_request(steps=EVAL_STEPS))
    correct, total = result.table["overall"]
    assert total == len(scenes.eval_prompts()) == len(result.images)
    low, high = BASE_ACCURACY
    assert low <= correct / total <= high, shapes.format_accuracy_table(result.table)
    assert result.table["single"][0] > 0  # it draws at least some of the easiest scenes right


def test_a_training_run_evaluates_before_and_after_and_eval_shapes_reads_its_lora(
    training_server, tmp_path, capsys
):
    """`make train-shapes` in miniature: on policy every iteration, the eval tables and grids before
    and after (on the first EVAL_PROMPTS eval prompts), at the training's settings and at the server's
    defaults, and the final adapter pushed by eval_shapes.py scores exactly as the trainer's own final
    evals did (the same requests on the same weights)."""
    out = tmp_path / "train"
    rows = run_trainer(training_server, TRAINING, out)
    assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)
    assert [row["eval_accuracy"] != "nan" for row in rows] == [True, False]
    tables = json.loads((out / "eval.json").read_text())
    assert set(tables) == {"before", "after", "images", "paired", "defaults"}
    assert set(tables["defaults"]) == {"before", "after", "images", "paired"}
    prompts = list(scenes.eval_prompts())[:EVAL_PROMPTS]
    assert tables["before"]["overall"]["total"] == EVAL_PROMPTS
    assert float(rows[0]["eval_accuracy"]) == pytest.approx(
        tables["before"]["overall"]["correct"] / EVAL_PROMPTS
    )
    # The pairing compares the same images: its difference is that of the two accuracies.
    paired, images = tables["paired"], tables["images"]
    assert images["before"]["prompts"] == images["after"]["prompts"] == prompts
    assert paired["difference"] == pytest.approx(
        tables["after"]["accuracy"]["mean"] - tables["before"]["accuracy"]["mean"]
    )
    assert paired["images"] == EVAL_PROMPTS
    assert float(rows[0]["eval_se"]) == tables["before"]["accuracy"]["se"] > 0
    for name in ("accuracy.png", "reward.png", "samples/eval-before.png", "samples/eval-after.png"):
        assert Image.open(out / name).format == "PNG"

    table_path = tmp_path / "eval.json"
    flags = ["--lora", out / "lora", "--samples", "1", "--prompts", str(EVAL_PROMPTS), "--steps", "4"]
    flags += ["--seed", "2024", "--json", table_path]
    run_example("eval_shapes", "--server", training_server.address, *flags)
    printed = capsys.readouterr().out
    assert "| overall |" in printed and "at the server's defaults (its steps and CFG):" in printed
    # Both accuracies, at the training's settings and at the server's defaults, as the trainer's.
    assert json.loads(table_path.read_text()) == {
        "settings": tables["after"],
        "defaults": tables["defaults"]["after"],
    }
    assert float(rows[0]["eval_accuracy_defaults"]) == tables["defaults"]["before"]["accuracy"]["mean"]


@pytest.mark.parametrize(
    "flag", ["--window", "--kl-beta", "--grpo-guard", "--async", "--score-while-streaming"]
)
def test_nft_refuses_the_flowgrpo_flags(flag, capsys):
    value = {"--window": ["2"], "--kl-beta": ["0.1"]}.get(flag, [])
    with pytest.raises(SystemExit) as refused:
        example_module("train_grpo").parse_args(["--algorithm", "nft", flag, *value])
    assert refused.value.code == 2
    assert f"{flag} is for FlowGRPO: --algorithm nft scores no step" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--eval-every", "--prompt-pool"])
def test_the_shapes_flags_need_the_shapes_prompt_set(flag, capsys):
    with pytest.raises(SystemExit) as refused:
        example_module("train_grpo").parse_args([flag, "2"])
    assert refused.value.code == 2
    assert f"{flag} is for the shapes task: it needs --prompt-set shapes" in capsys.readouterr().err


def test_eval_shapes_takes_the_first_prompts_and_refuses_a_negative_count(capsys):
    parse_args = example_module("eval_shapes").parse_args
    request = eval_request(prompts=parse_args(["--prompts", "3"]).prompts)
    assert list(request.prompts) == list(scenes.eval_prompts()[:3])
    with pytest.raises(SystemExit) as refused:
        parse_args(["--prompts", "-1"])
    assert refused.value.code == 2
    assert "--prompts must be 0 (every eval prompt) or more" in capsys.readouterr().err


def mean_dense_reward(client) -> float:
    trajectories = client.rollout(MEASURE)
    return (
        shapes.geneval_reward([t.image() for t in trajectories], [t.prompt for t in trajectories])
        .mean()
        .item()
    )


def test_anchored_nft_on_two_prompts_raises_their_dense_reward_near_the_base_velocities(
    training_server, family_resources, tmp_path
):
    """A short run of anchored DiffusionNFT (the x0 loss, an old policy that rolls out and follows the
    trained one, an anchor to the base model): the dense reward rises on the trainer's own rollouts and
    on 64 held fixed seeds, measured on the base model (the family server) and on the final policy (the
    training server ends on it), while the trained velocities stay within VELOCITY_NORM_BOUND of the
    base model's at the probe's points."""
    rows = run_trainer(training_server, NFT_TRAINING, tmp_path / "nft")
    assert all(
        row["ratio_max_dev"] == "nan" and row["scored_steps"] == "" for row in rows
    )  # no step is scored
    assert [int(row["policy_version"]) for row in rows] == [int(row["pushed_version"]) for row in rows]
    assert all(0 < float(row["anchor_grad_norm"]) < float(row["policy_grad_norm"]) for row in rows)
    ratios = [float(row["velocity_norm_ratio"]) for row in rows]
    assert all(1 / VELOCITY_NORM_BOUND < ratio < VELOCITY_NORM_BOUND for ratio in ratios), ratios
    rewards = torch.tensor([float(row["reward_mean"]) for row in rows])
    assert rewards[-2:].mean() > rewards[:2].mean() + 0.03, rewards  # measured here: 0.641 -> 0.747

    before = mean_dense_reward(family_resources.client("shapes"))
    with RolloutClient(training_server.address, timeout=300) as client:
        after = mean_dense_reward(client)
    # Measured here: 0.633 -> 0.688; with the trainer's --seed 1 and 2, -> 0.703 and -> 0.750.
    assert after > before + 0.03, (before, after)
