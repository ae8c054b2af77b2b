"""FLUX.1 Kontext on the tiny-flux-kontext preset: a conditioning image's env is FluxKontextPipeline's own
(its VAE latents packed into tokens, their position ids), the text's env holds nothing of the image, and a
rollout steps as the pipeline's own loop does, through the adapter and over gRPC. Server info, replay
parity and SP=2 (the split cuts the generated and the image's tokens together) are in test_contract.py with
the other families."""

import numpy as np
import pytest
import torch
from support.adapters import adapter_ode, joint_attention_tokens
from support.families import FAMILIES, family_request
from support.requests import condition_image
from support.servers import at_server_threads

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.families.base import MediaShape

SHAPE = MediaShape(frames=1, height=64, width=64)
TOKENS = (64 // 16) ** 2  # 8x VAE, 2x2 patches
CONDITIONING = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, "image_latents")


@pytest.fixture
def family() -> str:
    return "flux-kontext"


def run_pipeline(pipe, prompts, images, x0: torch.Tensor, guidance_scale: float, cfg: dict):
    """FluxKontextPipeline's own final latents from ``x0``, and its images, at the request's size: no
    resize to a preferred Kontext resolution, and ``max_area`` that of the request, which it would
    rescale to."""
    latents = []

    def record_latents(pipe, step, timestep, tensors):
        latents.append(tensors["latents"])
        return {}

    images = pipe(
        image=images,
        prompt=list(prompts),
        height=SHAPE.height,
        width=SHAPE.width,
        max_area=SHAPE.height * SHAPE.width,
        _auto_resize=False,
        num_inference_steps=4,
        guidance_scale=guidance_scale,
        latents=x0,
        callback_on_step_end=record_latents,
        **cfg,
    ).images
    return latents[-1], images


@torch.no_grad()  # as the pipeline runs: T5's attention rounds differently with autograd
def test_env_is_the_pipelines_own(adapter, family_pipeline):
    """The image's entries are those FluxKontextPipeline.prepare_latents and __call__ build, bitwise,
    and follow the independent formula: the VAE's latent mode, shifted and scaled, cut into 2x2
    patches row-major; ids (0, row, column) for the generated tokens, then (1, row, column) for the
    image's. The text's entries are its encode_prompt's and the embedded guidance, without img_ids."""
    pipe, image = family_pipeline, condition_image(0)
    text_env = adapter.encode_text("make the fox red", 2.5, SHAPE)
    image_env = adapter.encode_image(image, SHAPE)
    assert "img_ids" not in text_env and set(image_env) == {"image_latents", "img_ids"}

    pixels = pipe.image_processor.preprocess(image, SHAPE.height, SHAPE.width)
    noise = torch.randn(1, TOKENS, 16, generator=torch.Generator().manual_seed(0))
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        pixels, 1, 4, SHAPE.height, SHAPE.width, torch.float32, torch.device("cpu"), latents=noise
    )
    assert torch.equal(image_env["image_latents"], image_latents)
    assert torch.equal(image_env["img_ids"], torch.cat([latent_ids, image_ids]))

    vae = pipe.vae
    z = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    patches = z.view(1, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, TOKENS, 16)
    assert torch.equal(image_env["image_latents"], patches)
    grid = [(row, col) for row in range(4) for col in range(4)]
    ids = [(first, row, col) for first in (0, 1) for row, col in grid]
    assert image_env["img_ids"].tolist() == [list(map(float, i)) for i in ids]

    embeds, pooled, txt_ids = pipe.encode_prompt(prompt=["make the fox red"], prompt_2=None)
    assert torch.equal(text_env["encoder_hidden_states"], embeds)
    assert torch.equal(text_env["pooled_projections"], pooled)
    assert torch.equal(text_env["txt_ids"], txt_ids)
    assert torch.equal(text_env["guidance"], torch.tensor([2.5]))


def test_forward_activation_counts_the_image_tokens(adapter):
    """The tokens the first block's joint attention runs over: the generated ones, the image's (as
    many: the image is at the request's size) and the text's, as forward_activation counts them."""
    env = {**adapter.encode_text("a fox", 2.5, SHAPE), **adapter.encode_image(condition_image(0), SHAPE)}
    attended = joint_attention_tokens(adapter, env, SHAPE)
    assert adapter.conditioning_tokens(SHAPE) == adapter.generated_tokens(SHAPE) == TOKENS
    assert attended == adapter.forward_activation(SHAPE)[0] == 2 * TOKENS + adapter.text_tokens


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_ode_loop_matches_the_pipeline(adapter, family_pipeline, cfg):
    """Euler over the adapter's schedule, each velocity from the transformer rule with the adapter's
    envs (text merged with image, batched as the server batches them) and true CFG: within 1e-5 of
    FluxKontextPipeline's own loop from the same x_0, whose sigmas (the shift of the generated
    tokens only) are the adapter's, bitwise."""
    spec = FAMILIES["flux-kontext"]
    settings = spec.cfg_on if cfg else spec.cfg_off
    images = [condition_image(p) for p in range(len(spec.prompts))]
    x0 = torch.randn(len(images), *adapter.latent_shape(SHAPE), generator=torch.Generator().manual_seed(3))
    sigmas, _ = adapter.schedule(4, SHAPE)

    texts = {"positive": spec.prompts}
    if cfg:
        texts["negative"] = [settings["negative_prompt"]] * len(images)
    rule = ("true_cfg", settings["true_cfg_scale"]) if cfg else ("none", 1.0)
    x = adapter_ode(adapter, x0, texts, images, 2.5, rule, SHAPE)

    pipe = family_pipeline
    final, _ = run_pipeline(pipe, spec.prompts, images, x0, 2.5, settings)
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    torch.testing.assert_close(x, final, atol=1e-5, rtol=0)


@torch.no_grad()
def test_ode_rollout_matches_the_pipeline(adapter, family_client, family_pipeline):
    """Over gRPC with true CFG: the stream states the sequence concatenation of image_latents, its env
    holds the pipeline's own image latents, and from the same x_0 FluxKontextPipeline reaches the
    streamed final latents and images."""
    spec = FAMILIES["flux-kontext"]
    request = family_request("flux-kontext", "ODE", cfg=True, samples_per_prompt=1, images=True)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    images = [condition_image(p) for p in range(len(spec.prompts))]
    for trajectory, image in zip(trajectories, images, strict=True):
        assert trajectory.transformer_call.conditioning == CONDITIONING
        with at_server_threads():  # the pipeline's own (test_env_is_the_pipelines_own), as the server ran it
            image_env = adapter.encode_image(image, SHAPE)
        for env in trajectory.env.values():
            assert torch.equal(env["image_latents"], image_env["image_latents"])
            assert torch.equal(env["img_ids"], image_env["img_ids"])
            assert torch.equal(env["guidance"], torch.tensor([2.5]))  # the default, unset in the request
    x0 = torch.stack([t.latents[0] for t in trajectories])
    final, decoded = run_pipeline(pipe, request.prompts, images, x0, 2.5, spec.cfg_on)
    torch.testing.assert_close(torch.stack([t.latents[-1] for t in trajectories]), final, atol=1e-5, rtol=0)
    for trajectory, image in zip(trajectories, decoded, strict=True):
        assert trajectory.image().size == (SHAPE.width, SHAPE.height)
        diff = np.asarray(trajectory.image(), dtype=int) - np.asarray(image, dtype=int)
        assert np.abs(diff).max() <= 1  # uint8 rounding of nearly equal latents
