"""The SD3 family over gRPC on the tiny-sd3 preset: the pipeline's own schedule and sampling. Detection is in
test_families.py; replay parity (docs/design.md, invariant 1) with SD3's classic CFG on and off and server
info are test_contract.py's, parametrized over the families.

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
