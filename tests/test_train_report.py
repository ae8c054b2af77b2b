"""What a run reports and what users add: ``--report-to tensorboard`` writes the metrics, the sample
grids and each prompt's reward as TensorBoard events (read back here with TensorBoard's own reader),
and docs/training.md's algorithm and reward, run as written, train and are logged."""

import math
import re

import numpy
import pytest
import torch
from support.parity import TOLERANCE
from support.servers import ROOT
from support.train_runs import run_trainer, training_server
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rollout_client import RolloutClient
from rollout_client.images import LABEL_HEIGHT
from rollout_client.train.algorithms import ALGORITHMS
from rollout_client.train.prompts import PROMPTS
from rollout_client.train.report import TensorBoard

# Every event of a kind, not TensorBoard's default sample of them.
EVERY_EVENT = {"scalars": 0, "images": 0, "tensors": 0}


@pytest.fixture(scope="module")
def train_client(cache_dir, tiny_flux_folder, tmp_path_factory):
    server = training_server(cache_dir, tmp_path_factory.mktemp("report") / "server.log")
    try:
        with RolloutClient(server.address, timeout=120) as client:
            yield client
    finally:
        server.stop()


def events(folder) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance=EVERY_EVENT)
    accumulator.Reload()
    return accumulator


def test_a_run_reports_its_metrics_samples_and_rewards_per_prompt_to_tensorboard(train_client, tmp_path):
    """Two iterations of 2 prompts x 3 samples: each numeric metrics.csv column is a scalar at its
    iteration, and the first and last iteration have their sample grid (a row of 3 per prompt) and each
    prompt's mean reward."""
    out = tmp_path / "train"
    rows = run_trainer(train_client.address, out, "--iterations", "2", "--report-to", "tensorboard")
    board = events(out / "tensorboard")
    for column in ("reward_mean", "reward_std", "loss", "ratio_max_dev", "rollout_seconds"):
        scalars = board.Scalars(f"train/{column}")
        assert [event.step for event in scalars] == [0, 1]
        # An event holds a float32: the csv's float64 rounded once, so equal to that rounding.
        assert [event.value for event in scalars] == [float(numpy.float32(row[column])) for row in rows]
    assert "train/kl" not in board.Tags()["scalars"]  # nan without --kl-beta: no point to draw
    for prompt in ("p00", "p01"):
        assert [event.step for event in board.Scalars(f"reward_per_prompt/{prompt}")] == [0, 1]
    # The prompts' means average to the iteration's mean (3 float32 rewards each: a few ulps apart).
    for step, row in enumerate(rows):
        means = [board.Scalars(f"reward_per_prompt/{p}")[step].value for p in ("p00", "p01")]
        assert sum(means) / 2 == pytest.approx(float(row["reward_mean"]), rel=1e-5)
    grids = board.Images("samples/images")
    assert [image.step for image in grids] == [0, 1]
    assert (grids[0].width, grids[0].height) == (3 * 64, 2 * (LABEL_HEIGHT + 64))
    [table, _] = board.Tensors("samples/reward_per_prompt/text_summary")  # the table, as text
    assert f"| 0 | {PROMPTS[0]} | " in table.tensor_proto.string_val[0].decode()
    assert (out / "metrics.csv").exists() and (out / "reward.png").exists()  # the files stay


def test_an_eval_is_reported_with_its_standard_error(tmp_path):
    """A metrics row with an eval gives the accuracy, its standard error, and the band one standard
    error either side that the custom chart draws."""
    report = TensorBoard(tmp_path)
    report.row({"iteration": 4, "reward_mean": 0.25, "eval_accuracy": 0.5, "eval_se": 0.125, "kl": math.nan})
    report.accuracy(0.75, 0.0625, 6)  # the eval after the last iteration
    report.close()
    board = events(tmp_path)
    expected = {
        "eval/accuracy": [(4, 0.5), (6, 0.75)],
        "eval/accuracy_stderr": [(4, 0.125), (6, 0.0625)],
        "eval/accuracy_lower": [(4, 0.375), (6, 0.6875)],
        "eval/accuracy_upper": [(4, 0.625), (6, 0.8125)],
        "train/reward_mean": [(4, 0.25)],
        "train/eval_accuracy": [(4, 0.5)],
    }
    # Sums of dyadic fractions: exact in float32.
    for tag, points in expected.items():
        assert [(event.step, event.value) for event in board.Scalars(tag)] == points, tag


def training_doc_block(section: str, language: str = "python") -> str:
    """The first ``language`` code block under docs/training.md's heading ``section``."""
    text = (ROOT / "docs" / "training.md").read_text()
    body = re.split(r"\n##+ ", text.split(f"### {section}\n", 1)[1], maxsplit=1)[0]
    return re.search(rf"```{language}\n(.*?)```", body, re.DOTALL)[1]


def test_the_documented_algorithm_trains_with_its_own_advantages(train_client, tmp_path):
    """docs/training.md's "Add an algorithm", run as written: it registers, --algorithm selects it,
    two iterations train on policy, and its advantages are the formula it states (float64 here)."""
    namespace = {}
    exec(compile(training_doc_block("Add an algorithm"), "training.md", "exec"), namespace)
    try:
        rows = run_trainer(train_client.address, tmp_path / "train", "--algorithm", "flowgrpo-global-std")
        assert len(rows) == 3 and all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)
        algorithm = ALGORITHMS["flowgrpo-global-std"]
        rewards = torch.tensor([0.1, 0.4, 0.2, 0.9, 0.5, 0.3])
        trajectories = [type("Sample", (), {"prompt_index": p})() for p in (0, 0, 0, 1, 1, 1)]
        advantages = algorithm.advantages(None, trajectories, rewards)
        r = rewards.double()
        means = torch.tensor([r[:3].mean()] * 3 + [r[3:].mean()] * 3)
        expected = (r - means) / (r.std(correction=0) + 1e-4)
        # fp32 means, std and one division against float64: a few u (6e-8) relative, within 1e-6.
        torch.testing.assert_close(advantages.double(), expected, rtol=1e-6, atol=0)
    finally:
        ALGORITHMS.pop("flowgrpo-global-std", None)


def test_the_documented_reward_is_summed_with_its_weights_and_logged(train_client, tmp_path, monkeypatch):
    """docs/training.md's "Add a reward": a module of the user's with metadata, in a weighted sum with
    JPEG compressibility; metrics.csv logs each term, and reward_mean is their weighted sum."""
    (tmp_path / "my_rewards.py").write_text(training_doc_block("Add a reward"))
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = re.search(r'--reward "([^"]+)"', training_doc_block("Add a reward", "sh"))[1]
    rows = run_trainer(train_client.address, tmp_path / "train", "--reward", flags)
    for row in rows:
        brightness = float(row["reward_mean/my_rewards:brightness"])
        jpeg = float(row["reward_mean/rollout_client.rewards:jpeg_compressibility"])
        assert 0 < brightness < 1 and jpeg < 0
        # The mean of a weighted sum of 6 float32 values against the sum of the means: a few ulps.
        assert float(row["reward_mean"]) == pytest.approx(0.5 * brightness + jpeg, rel=1e-5)
