"""The Qwen-Image family over gRPC on the tiny-qwen-image preset: the template's prefix and the
pipeline's own schedule and sampling. Detection is in test_families.py; per-prompt conditioning
lengths, replay parity with true CFG (norm rescale) on and off, server info and SP=2 with texts of uneven
lengths are test_contract.py's, parametrized over the families.

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
