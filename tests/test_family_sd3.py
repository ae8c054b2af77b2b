"""The SD3 family over gRPC on the tiny-sd3 preset: server info and the pipeline's own schedule and
sampling. Detection is in test_families.py; replay parity (docs/design.md, invariant 1) with SD3's
classic CFG on and off is test_replay.py's, parametrized over the families.

SD3 differs from Flux in every convention a trainer replays with: unpacked [C, H/8, W/8] latents, the raw
timestep (no / 1000), a static-shift schedule, and CFG driven by ``guidance_scale`` with the negative
prompt as its own env branch.
"""

import numpy as np
import pytest
import torch
from support.families import family_request


@pytest.fixture
def family() -> str:
    return "sd3"


def test_server_info(family_client):
    info = family_client.server_info()
    assert (info.family, info.pipeline_class) == ("sd3", "StableDiffusion3Pipeline")
    assert (info.cfg_scale_field, info.cfg_rule, info.timestep_rule) == (
        "guidance_scale",
        "true_cfg",
        "timestep",
    )
    defaults = info.defaults
    assert (defaults.height, defaults.width, defaults.num_steps) == (128, 128, 10)  # the preset's
    assert (defaults.guidance_scale, defaults.true_cfg_scale) == (4.5, 1.0)  # SD3.5-Medium's
    assert defaults.noise_level == pytest.approx(0.7)
    assert info.limits.side_multiple == 16  # 8x VAE, 2x2 patches
    assert (info.limits.max_frames, defaults.num_frames) == (1, 1)  # an image family


def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline):
    """Schedule, env, raw timestep and CFG all as StableDiffusion3Pipeline: from the same x_0, its own
    sampling loop reaches the streamed final latents."""
    request = family_request("sd3", "ODE", cfg=True, samples_per_prompt=1)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    pipe.scheduler.set_timesteps(4)
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), pipe.scheduler.sigmas.numpy())
    np.testing.assert_array_equal(trajectories[0].timesteps[:-1].numpy(), pipe.scheduler.timesteps.numpy())
    final = pipe(
        prompt=list(request.prompts),
        negative_prompt=request.negative_prompt,
        latents=torch.stack([t.latents[0] for t in trajectories]),
        height=64,
        width=64,
        num_inference_steps=4,
        guidance_scale=4.5,
        output_type="latent",
    ).images
    torch.testing.assert_close(
        final, torch.stack([t.latents[-1] for t in trajectories]), atol=1e-4, rtol=1e-4
    )
