"""Wan text-to-video on the tiny-wan (2.1) and tiny-wan2.2 (two experts) presets: the server's
schedule, transformer call, expert choice, CFG (Wan 2.2's second scale and boundary included) and
decoding are WanPipeline's own; frames are streamed as one PNG each; a
weight update names the expert it changes. Server info, frame bounds (4k + 1) and replay parity are
in test_contract.py with the other families, replay also here for Wan 2.2's two scales."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from support.errors import refused_rollout
from support.families import FAMILIES, family_request
from support.parity import TOLERANCE, assert_replays
from support.requests import split_events

from rollout_client.images import LABEL_HEIGHT
from rollout_core import solvers
from rollout_server.families.wan.preset import WAN22_BOUNDARY_RATIO

BOTH = pytest.mark.parametrize("family", ["wan", "wan2.2"])


@BOTH
def test_the_second_experts_defaults_are_set_where_there_is_one(family_client, family):
    """The pipeline's boundary where there are two experts; guidance_scale_2 left unset: it follows
    guidance_scale. The rest of GetServerInfo is the contract's (test_contract.py)."""
    defaults = family_client.server_info().defaults
    assert (defaults.HasField("boundary_ratio"), defaults.HasField("guidance_scale_2")) == (
        family == "wan2.2",
        False,
    )
    if family == "wan2.2":
        assert defaults.boundary_ratio == WAN22_BOUNDARY_RATIO  # 0.875, exact in float32


# Wan 2.2's second scale (2.5, below the first's 5), alone and with a boundary of the request's own:
# of the timesteps 999, 900, 750 and 500, 0.875 puts the last two on transformer_2, 0.999 the last
# three. 0.999 rounds up in float32 (0.99900001), which read as such would put timestep 999 on
# transformer_2 too: the pipeline's 0.999 keeps it on transformer.
SECOND_SCALE = {"guidance_scale_2": 2.5}
SECOND_SCALE_AND_BOUNDARY = {"guidance_scale_2": 2.5, "boundary_ratio": 0.999}


@pytest.mark.parametrize(
    ("family", "solver", "cfg", "second_expert"),
    [
        ("wan", "unipc", True, {}),
        ("wan", "unipc", False, {}),
        ("wan", "euler", True, {}),
        ("wan2.2", "unipc", True, {}),
        ("wan2.2", "unipc", True, SECOND_SCALE),
        ("wan2.2", "unipc", True, SECOND_SCALE_AND_BOUNDARY),
    ],
    ids=[
        "wan-unipc-cfg",
        "wan-unipc",
        "wan-euler-cfg",
        "wan2.2-cfg",
        "wan2.2-scale2",
        "wan2.2-scale2-boundary",
    ],
)
def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline, family, solver, cfg, second_expert):
    """Schedule (UniPC's shifted flow sigmas and integer timesteps), env, raw timestep, expert per step
    and CFG all as WanPipeline: from the same x_0, its own ``__call__`` with its own UniPC scheduler
    reaches the streamed final latents of the family's default solver, and its loop stepping with
    Euler over the same sigmas those of ``solver=euler``; Wan 2.2's ``guidance_scale_2`` as the
    pipeline's argument, and a request's ``boundary_ratio`` as the pipeline's config. With CFG the
    pipeline runs both branches in one forward and the server each apart: Batch and split rounding
    (docs/testing.md), TOLERANCE in v times up to 2s - 1 = 9 at scale 5 (less at 2.5), 1e-4. Without
    CFG both run the two prompts' rows in one forward of one branch, and the UniPC steps are
    diffusers' own arithmetic: TOLERANCE."""
    fields = {} if solver == "unipc" else {"solver": solvers.SOLVERS[solver].enum}
    request = family_request(family, "ODE", cfg=cfg, samples_per_prompt=1, **fields, **second_expert)
    trajectories = family_client.rollout(request)
    assert trajectories[0].solver == solver
    call = trajectories[0].transformer_call
    if second_expert:
        # Each step's scale is its expert's.
        scales = {"transformer": 5.0, "transformer_2": second_expert["guidance_scale_2"]}
        assert list(call.guidance_rule_scales) == [scales[e] for e in trajectories[0].step_transformers]
        ratio = second_expert.get("boundary_ratio", WAN22_BOUNDARY_RATIO)
        assert trajectories[0].step_transformers == [
            "transformer" if t >= ratio * 1000 else "transformer_2" for t in trajectories[0].timesteps[:-1]
        ]
    else:
        assert call.guidance_rule_scales == ((5.0,) * 4 if family == "wan2.2" else ())
    sigmas, timesteps = trajectories[0].sigmas, trajectories[0].timesteps
    pipe = family_pipeline
    unipc = pipe.scheduler
    unipc.set_timesteps(4)
    np.testing.assert_array_equal(sigmas.numpy(), unipc.sigmas.numpy())
    np.testing.assert_array_equal(timesteps[:-1].numpy(), unipc.timesteps.float().numpy())
    scheduler = unipc  # WanPipeline's own
    if solver == "euler":
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)

        def set_timesteps(num_inference_steps, device=None):
            # Euler steps over UniPC's sigmas; the transformer gets UniPC's integer timesteps, as
            # served (Euler's own would be sigma * 1000).
            FlowMatchEulerDiscreteScheduler.set_timesteps(
                scheduler, sigmas=sigmas[:-1].tolist(), device=device
            )
            scheduler.timesteps = timesteps[:-1].clone()

        scheduler.set_timesteps = set_timesteps
    pipe.scheduler = scheduler
    boundary_ratio = pipe.config.boundary_ratio
    pipe.register_to_config(boundary_ratio=second_expert.get("boundary_ratio", boundary_ratio))
    try:
        final = pipe(
            prompt=list(request.prompts),
            negative_prompt=request.negative_prompt,
            latents=torch.stack([t.latents[0] for t in trajectories]),
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=request.guidance_scale,
            guidance_scale_2=second_expert.get("guidance_scale_2"),
            output_type="latent",
        ).frames
    finally:
        pipe.scheduler = unipc
        pipe.register_to_config(boundary_ratio=boundary_ratio)
    bound = 1e-4 if cfg else TOLERANCE
    torch.testing.assert_close(
        final, torch.stack([t.latents[-1] for t in trajectories]), atol=bound, rtol=bound
    )


@pytest.mark.parametrize("family", ["wan"])
def test_each_sample_streams_its_frames_as_the_pipeline_decodes_them(family_client, family_pipeline):
    trajectories = family_client.rollout(
        family_request("wan", "FLOW_SDE", cfg=False, images=True, num_frames=9)
    )
    pipe = family_pipeline
    vae = pipe.vae
    stats = (1, vae.config.z_dim, 1, 1, 1)
    latents = torch.stack([t.latents[-1] for t in trajectories])
    assert latents.shape[2] == 3  # 9 frames: 3 latent frames
    mean, std = (
        torch.tensor(vae.config.latents_mean).view(stats),
        torch.tensor(vae.config.latents_std).view(stats),
    )
    with torch.no_grad():
        video = vae.decode(latents * std + mean, return_dict=False)[0]
    expected = pipe.video_processor.postprocess_video(video, output_type="np")  # [B, F, H, W, 3] in [0, 1]
    for k, trajectory in enumerate(trajectories):
        frames = trajectory.frames()
        assert len(frames) == 9 and all(frame.size == (64, 64) for frame in frames)
        assert trajectory.image_png == trajectory.frames_png[0]
        got = np.stack([np.asarray(frame.convert("RGB"), dtype=np.float64) for frame in frames])
        np.testing.assert_allclose(got, np.round(expected[k] * 255), atol=1)


@pytest.mark.parametrize("family", ["wan"])
def test_the_cli_writes_an_animated_preview_and_a_sheet_of_first_frames(family_resources, family, tmp_path):
    from PIL import Image

    from rollout_client.cli import main

    out = tmp_path / "video"
    address = family_resources.server(family).address
    argv = ["rollout", "--address", address, "a red fox", "a kite", "--samples-per-prompt", "2"]
    assert main([*argv, "--frames", "9", "--steps", "2", "--out", str(out)]) == 0
    for k in range(4):
        with Image.open(out / f"sample-{k}.gif") as preview:
            assert (preview.n_frames, preview.size) == (9, (64, 64))
    # First frames, a row per prompt under its label.
    assert Image.open(out / "contact-sheet.png").size == (2 * 64, 2 * (LABEL_HEIGHT + 64))


@pytest.mark.parametrize("family", ["wan2.2"])
def test_the_cli_sets_the_second_experts_fields(family_resources, family, tmp_path):
    from rollout_client.cli import main

    address = family_resources.server(family).address
    options = ["--guidance", "5", "--guidance-2", "2.5", "--boundary-ratio", "0.999", "--steps", "2"]
    assert main(["rollout", "--address", address, "a red fox", *options, "--out", str(tmp_path)]) == 0
    request = json.loads((tmp_path / "rollout.json").read_text())["request"]
    assert (request["guidance_scale"], request["guidance_scale_2"]) == (5.0, 2.5)
    assert request["boundary_ratio"] == pytest.approx(0.999, rel=2**-24)  # float32, as JSON


@pytest.mark.parametrize("family", ["wan"])
def test_a_latent_above_the_servers_bound_is_refused(family, family_folder):
    """``--max-latent-elements`` bounds one sample's latent: 9 frames at 64 x 64 are 16 x 3 x 8 x 8 =
    3072 elements, 5 frames 2048."""
    from rollout_server import families
    from rollout_server.errors import InvalidRequest
    from rollout_server.limits import Limits
    from rollout_server.presets import defaults_for
    from rollout_server.validation import ServingContext, resolve

    adapter = families.load(family_folder, torch.device("cpu"), torch.float32)
    bounded = Limits(max_latent_elements=3000)
    serving = ServingContext.of(adapter, defaults_for(FAMILIES[family].preset, adapter.defaults()), bounded)
    assert (
        bounded.to_proto(
            adapter.side_multiple, adapter.min_side, adapter.max_frames, adapter.frame_step
        ).max_latent_elements
        == 3000
    )
    assert resolve(family_request(family, "ODE", cfg=False, num_frames=5), serving).num_frames == 5
    with pytest.raises(InvalidRequest) as refused:
        resolve(family_request(family, "ODE", cfg=False, num_frames=9), serving)
    assert [field for field, _ in refused.value.violations] == ["num_frames"]


@pytest.mark.parametrize("family", ["wan2.2"])
@pytest.mark.parametrize(
    "second_expert", [SECOND_SCALE, SECOND_SCALE_AND_BOUNDARY], ids=["scale2", "boundary"]
)
def test_each_step_replays_under_its_experts_scale(family_client, family_transformer, family, second_expert):
    """Every stochastic step of a rollout under two scales replays within TOLERANCE through the client
    (``step_transformers`` picks the expert, ``guidance_rule_scales`` its scale) and through a bare
    diffusers call with the float64 formulas; with the first scale at every step instead, the steps
    of transformer_2 do not."""
    trajectories = family_client.rollout(family_request(family, "FLOW_SDE", cfg=True, **second_expert))
    assert "transformer_2" in trajectories[0].step_transformers
    assert_replays(family_transformer, trajectories, bare_reference=True)
    one_scale = [
        dataclasses.replace(
            t, transformer_call=dataclasses.replace(t.transformer_call, guidance_rule_scales=())
        )
        for t in trajectories
    ]
    with pytest.raises(AssertionError):
        assert_replays(family_transformer, one_scale)


@pytest.mark.parametrize("family", ["wan2.2"])
def test_the_second_experts_fields_are_echoed_resolved(family_client, family):
    """Unset, guidance_scale_2 resolves to guidance_scale (WanPipeline's default) and boundary_ratio to
    the pipeline's; set, they are echoed as sent (float32)."""
    one_step = {"samples_per_prompt": 1, "num_steps": 1}
    default = split_events(
        family_client.stream(family_request(family, "ODE", cfg=True, **one_step))
    ).started.message
    assert (default.resolved.guidance_scale_2, default.resolved.boundary_ratio) == (5.0, WAN22_BOUNDARY_RATIO)
    request = family_request(family, "ODE", cfg=True, **one_step, **SECOND_SCALE_AND_BOUNDARY)
    sent = split_events(family_client.stream(request)).started.message
    assert (sent.resolved.guidance_scale_2, sent.resolved.boundary_ratio) == (2.5, np.float32(0.999))
    assert list(sent.transformer_call.guidance_rule_scales) == [5.0]  # timestep 999: transformer


@pytest.mark.parametrize(
    ("family", "fields", "refused"),
    [
        ("wan2.2", {"guidance_scale_2": math.nan}, "guidance_scale_2"),
        ("wan2.2", {"guidance_scale_2": math.inf}, "guidance_scale_2"),
        ("wan2.2", {"guidance_scale_2": -0.5}, "guidance_scale_2"),
        ("wan2.2", {"guidance_scale_2": 100.5}, "guidance_scale_2"),
        ("wan2.2", {"boundary_ratio": math.nan}, "boundary_ratio"),
        ("wan2.2", {"boundary_ratio": -0.25}, "boundary_ratio"),
        ("wan2.2", {"boundary_ratio": 1.5}, "boundary_ratio"),
        # CFG off (guidance_scale 1): the pipeline would ignore a second scale.
        (
            "wan2.2",
            {"guidance_scale": 1.0, "negative_prompt": None, "guidance_scale_2": 3.0},
            "guidance_scale_2",
        ),
        # One expert: Wan 2.1, and a family of another kind.
        ("wan", {"guidance_scale_2": 3.0}, "guidance_scale_2"),
        ("wan", {"boundary_ratio": 0.5}, "boundary_ratio"),
        ("flux", {"guidance_scale_2": 3.0}, "guidance_scale_2"),
    ],
)
def test_the_second_experts_fields_are_bounded_and_refused_without_one(
    family_client, family, fields, refused
):
    violations = refused_rollout(family_client, family_request(family, "ODE", cfg=True, **fields))
    assert [violation.field for violation in violations] == [refused]
