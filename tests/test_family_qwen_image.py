"""The Qwen-Image family over gRPC on the tiny-qwen-image preset: server info, the template's prefix and
the pipeline's own schedule and sampling. Detection is in test_families.py; per-prompt conditioning
lengths and replay parity with true CFG (norm rescale) on and off are test_replay.py's, parametrized over
the families.

Qwen-Image's env differs from Flux's where SGLang-Diffusion's users got hurt: every prompt has its own text
length, so a request mixing prompt lengths must give each sample the env of its own prompt, unpadded.
"""

import numpy as np
import pytest
import torch
from support.families import LONG_PROMPT, SHORT_PROMPT, family_request, qwen_text_length


@pytest.fixture
def family() -> str:
    return "qwen-image"


def test_server_info(family_client):
    info = family_client.server_info()
    assert (info.family, info.pipeline_class) == ("qwen-image", "QwenImagePipeline")
    assert (info.cfg_scale_field, info.cfg_rule, info.timestep_rule) == (
        "true_cfg_scale",
        "true_cfg_norm_rescale",
        "timestep / 1000",
    )
    defaults = info.defaults
    assert (defaults.height, defaults.width, defaults.num_steps) == (128, 128, 10)  # the preset's
    assert (defaults.guidance_scale, defaults.true_cfg_scale) == (1.0, 4.0)  # Qwen-Image's
    assert defaults.noise_level == pytest.approx(0.7)
    assert info.limits.side_multiple == 16  # 8x VAE, 2x2 patches
    assert (info.limits.max_frames, defaults.num_frames) == (1, 1)  # an image family


def test_template_prefix_is_dropped_exactly(family_pipeline):
    """As with Qwen2's real vocabulary, the pipeline's fixed drop count removes exactly the system prefix:
    what is left is the prompt's own tokens and the template's closing ones, even for a one-word prompt."""
    pipe = family_pipeline
    prefix, suffix = pipe.prompt_template_encode.split("{}")
    tokenizer = pipe.tokenizer
    assert len(tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    for prompt in ("fox", SHORT_PROMPT, LONG_PROMPT):
        expected = len(tokenizer(prompt).input_ids) + len(tokenizer(suffix).input_ids)
        assert qwen_text_length(pipe, prompt) == expected, prompt


def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline):
    """Schedule, env, timestep / 1000, true CFG with norm rescale and decoding all as QwenImagePipeline:
    from the same x_0, its own loop (a padded, masked batch of both prompts) reaches the streamed final
    latents and images."""
    request = family_request("qwen-image", "ODE", cfg=True, samples_per_prompt=1, images=True)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    latents = []

    def record_latents(pipe, step, timestep, tensors):
        latents.append(tensors["latents"])
        return {}

    images = pipe(
        prompt=list(request.prompts),
        negative_prompt=request.negative_prompt,
        true_cfg_scale=request.true_cfg_scale,
        latents=torch.stack([t.latents[0] for t in trajectories]),
        height=64,
        width=64,
        num_inference_steps=4,
        callback_on_step_end=record_latents,
    ).images
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), pipe.scheduler.sigmas.numpy())
    np.testing.assert_array_equal(trajectories[0].timesteps[:-1].numpy(), pipe.scheduler.timesteps.numpy())
    streamed = torch.stack([t.latents[-1] for t in trajectories])
    torch.testing.assert_close(latents[-1], streamed, atol=1e-5, rtol=0)
    for trajectory, image in zip(trajectories, images, strict=True):
        assert trajectory.image().size == (64, 64)
        diff = np.asarray(trajectory.image(), dtype=int) - np.asarray(image, dtype=int)
        assert np.abs(diff).max() <= 1  # uint8 rounding of nearly equal latents
