"""The pretrained shapes preset through real servers. It draws the scenes it is asked for often enough
to be a useful base model, and not so often that RL has nothing to lift (GenEval's regime); a
training run on its train prompts evaluates the policy on the eval prompts before and after; and
examples/eval_shapes.py prints the GenEval-style table of the policy a LoRA folder holds. Replay
parity is in test_replay.py and SP=2 parity in test_sp.py, with the other presets."""

import csv
import json
import subprocess
import sys

import pytest
from helpers import ROOT, TOLERANCE, example_module, start_server
from PIL import Image

from rollout_client.rewards import shapes
from rollout_client.shapes_eval import eval_request, evaluate_policy

# The committed model's strict accuracy on the eval prompts, one ODE sample each at EVAL_STEPS, must
# stay in this band (the full 20-step table is in docs/training.md).
BASE_ACCURACY = (0.2, 0.6)
EVAL_STEPS = 10
TRAINING = [
    "--prompt-set", "shapes",
    "--reward", "rollout_client.rewards.shapes:geneval_reward",
    "--iterations", "2", "--prompts", "2", "--group-size", "4", "--steps", "4", "--size", "64",
    "--window", "2", "--eval-every", "2",
]  # fmt: skip
WAIT_SECONDS = 600  # a safety net against a trainer that hangs, not a timing assertion
TRAINER = ROOT / "examples" / "train_grpo.py"


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


def test_the_base_model_is_right_on_some_scenes_and_wrong_on_others(family_resources):
    result = evaluate_policy(family_resources.client("shapes"), eval_request(steps=EVAL_STEPS))
    correct, total = result.table["overall"]
    assert total == len(shapes.eval_prompts()) == len(result.images)
    low, high = BASE_ACCURACY
    assert low <= correct / total <= high, shapes.format_accuracy_table(result.table)
    assert result.table["single"][0] > 0  # it draws at least some of the easiest scenes right


def test_a_training_run_evaluates_before_and_after_and_eval_shapes_reads_its_lora(training_server, tmp_path):
    """`make train-shapes` in miniature: on policy every iteration, the eval tables and grids before
    and after, and the final adapter pushed by eval_shapes.py scores exactly as the trainer's own
    final eval did (the same request on the same weights)."""
    out = tmp_path / "train"
    command = [sys.executable, TRAINER, "--server", training_server.address, *TRAINING, "--out", out]
    result = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_SECONDS)
    assert result.returncode == 0, result.stdout + result.stderr

    with open(out / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)
    assert [row["eval_accuracy"] != "nan" for row in rows] == [True, False]
    tables = json.loads((out / "eval.json").read_text())
    assert set(tables) == {"before", "after"}
    assert tables["before"]["overall"]["total"] == len(shapes.eval_prompts())
    assert float(rows[0]["eval_accuracy"]) == pytest.approx(tables["before"]["overall"]["correct"] / 64)
    for name in ("accuracy.png", "reward.png", "samples/eval-before.png", "samples/eval-after.png"):
        assert Image.open(out / name).format == "PNG"

    table_path = tmp_path / "eval.json"
    evaluate = [sys.executable, ROOT / "examples" / "eval_shapes.py", "--server", training_server.address]
    flags = ["--lora", out / "lora", "--samples", "1", "--steps", "4", "--seed", "2024", "--json", table_path]
    evaluated = subprocess.run([*evaluate, *flags], capture_output=True, text=True, timeout=WAIT_SECONDS)
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "| overall |" in evaluated.stdout
    assert json.loads(table_path.read_text()) == tables["after"]


@pytest.mark.parametrize("flag", ["--eval-every", "--prompt-pool"])
def test_the_shapes_flags_need_the_shapes_prompt_set(flag, capsys):
    with pytest.raises(SystemExit) as refused:
        example_module("train_grpo").parse_args([flag, "2"])
    assert refused.value.code == 2
    assert f"{flag} is for the shapes task: it needs --prompt-set shapes" in capsys.readouterr().err
