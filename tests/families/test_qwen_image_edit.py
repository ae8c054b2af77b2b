"""Qwen-Image-Edit on the tiny-qwen-image-edit preset: a prompt's env is QwenImageEditPipeline's own
encoding of the text with its image (the Qwen2.5-VL encoder reads the image), the image's env its own
packed VAE latents and both grids of img_shapes, and a rollout steps as the pipeline's own loop does,
through the adapter and over gRPC; a prompt's tokens are bounded once tokenised (the pipeline's
encoding truncates none). Detection is in test_families.py, server info and replay parity in
test_contract.py with the other families.

The pipeline resizes its image to about 1024 x 1024 pixels (``calculate_dimensions``) where the server
keeps the request's size: the comparisons with its ``__call__`` patch that function to give the
request's size, so both read the image as the server does."""

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit
from support.adapters import adapter_ode, joint_attention_tokens
from support.errors import refused_rollout
from support.families import FAMILIES, family_request
from support.requests import condition_image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server.families.base import MediaShape, denormalized

SPEC = FAMILIES["qwen-image-edit"]
SHAPE = MediaShape(frames=1, height=64, width=64)
TOKENS = (64 // 16) ** 2  # 8x VAE, 2x2 patches
CONDITIONING = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, "image_latents")


@pytest.fixture
def family() -> str:
    return "qwen-image-edit"


@pytest.fixture
def at_request_size(monkeypatch):
    """QwenImageEditPipeline reading its image at the request's size, as the server gives it."""
    size = lambda area, ratio: (SHAPE.width, SHAPE.height, None)  # noqa: E731
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", size)


def vision_tokens(pipe) -> int:
    """The VL encoder's tokens of a 64 x 64 image: the processor's 14-pixel patches of its 56 x 56
    resize (the nearest multiple of 28), merged 2x2."""
    processor = pipe.processor.image_processor
    assert (processor.patch_size, processor.merge_size) == (14, 2)
    return (56 // 14 // 2) ** 2


def test_template_prefix_is_dropped_exactly(family_pipeline):
    """The pipeline's fixed drop count removes exactly the edit template's system prefix: a prompt's
    embedding is the image's vision tokens between their markers, the prompt's tokens and the
    template's closing ones."""
    pipe = family_pipeline
    prefix, rest = pipe.prompt_template_encode.split("<|vision_start|>")
    tokenizer = pipe.tokenizer
    assert len(tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    image, closing = condition_image(0), rest.split("{}")[1]
    for prompt in SPEC.prompts:
        embeds, _ = pipe.encode_prompt(prompt, image=image)
        expected = 2 + vision_tokens(pipe) + len(tokenizer(prompt + closing).input_ids)
        assert embeds.shape == (1, expected, pipe.transformer.config.joint_attention_dim), prompt


@torch.no_grad()
def test_env_is_the_pipelines_own(adapter, family_pipeline):
    """The text's entries are encode_prompt's of the text and its image, bitwise, with another image
    another embedding; the image's are those prepare_latents and __call__ build, and follow the
    independent formula: the VAE's latent mode, normalised per channel, cut into 2x2 patches
    row-major; img_shapes the generated grid, then the image's."""
    pipe, image = family_pipeline, condition_image(0)
    text_env = adapter.encode_text("make the fox red", 1.0, SHAPE, image)
    image_env = adapter.encode_image(image, SHAPE)
    assert "img_shapes" not in text_env and set(image_env) == {"image_latents", "img_shapes"}

    embeds, mask = pipe.encode_prompt("make the fox red", image=image)
    assert torch.equal(text_env["encoder_hidden_states"], embeds)
    assert text_env["encoder_hidden_states_mask"] is mask is None  # one prompt: no padding
    assert text_env["guidance"] is None  # Qwen-Image-Edit is not guidance-distilled
    other = adapter.encode_text("make the fox red", 1.0, SHAPE, condition_image(1))
    assert other["encoder_hidden_states"].shape == embeds.shape
    assert not torch.equal(other["encoder_hidden_states"], embeds)

    pixels = pipe.image_processor.preprocess(image, SHAPE.height, SHAPE.width).unsqueeze(2)
    noise = torch.randn(1, TOKENS, 64, generator=torch.Generator().manual_seed(0))
    _, image_latents = pipe.prepare_latents(
        pixels, 1, 16, SHAPE.height, SHAPE.width, torch.float32, torch.device("cpu"), None, noise
    )
    assert torch.equal(image_env["image_latents"], image_latents)

    vae = pipe.vae
    stats = [torch.tensor(s).view(1, 16, 1, 1, 1) for s in (vae.config.latents_mean, vae.config.latents_std)]
    z = (vae.encode(pixels).latent_dist.mode() - stats[0]) / stats[1]
    patches = z.view(1, 16, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, TOKENS, 64)
    torch.testing.assert_close(image_env["image_latents"], patches, atol=1e-6, rtol=0)
    assert image_env["img_shapes"] == [[(1, 4, 4), (1, 4, 4)]]


def test_forward_activation_counts_the_image_tokens(adapter, family_pipeline):
    """The tokens the first block's joint attention runs over: the generated ones, the image's (as
    many: the image is at the request's size) and the text's, the VL encoder's image tokens among
    them; forward_activation counts the same with the longest prompt the pipeline takes."""
    image = condition_image(0)
    env = {**adapter.encode_text("a fox", 1.0, SHAPE, image), **adapter.encode_image(image, SHAPE)}
    attended = joint_attention_tokens(adapter, env, SHAPE)
    assert adapter.conditioning_tokens(SHAPE) == adapter.generated_tokens(SHAPE) == TOKENS
    pipe = family_pipeline
    prompt_tokens = len(pipe.tokenizer("a fox").input_ids)
    text = env["encoder_hidden_states"].shape[1]
    assert text == 7 + vision_tokens(pipe) + prompt_tokens  # markers, image, prompt, closing
    assert attended == 2 * TOKENS + text
    longest = attended - prompt_tokens + pipe.tokenizer_max_length
    assert adapter.forward_activation(SHAPE)[0] == longest


def pipeline_latents(pipe, prompts, images, x0: torch.Tensor, cfg: dict) -> torch.Tensor:
    """QwenImageEditPipeline's own final latents from ``x0`` (a padded, masked batch of the prompts,
    each with its image), at the request's size."""
    if "negative_prompt" in cfg:  # one per image
        cfg = {**cfg, "negative_prompt": [cfg["negative_prompt"]] * len(prompts)}
    return pipe(
        image=images,
        prompt=list(prompts),
        height=SHAPE.height,
        width=SHAPE.width,
        num_inference_steps=4,
        latents=x0,
        output_type="latent",
        **cfg,
    ).images


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_ode_loop_matches_the_pipeline(adapter, family_pipeline, at_request_size, cfg):
    """Euler over the adapter's schedule, each velocity from the transformer rule with the adapter's
    envs (text merged with image; each sample its own, unpadded) and true CFG with norm rescale,
    the negative prompt read with the same image: within 1e-5 of QwenImageEditPipeline's own loop
    from the same x_0, whose sigmas (the shift of the generated tokens only) are the adapter's,
    bitwise."""
    settings = SPEC.cfg_on if cfg else SPEC.cfg_off
    images = [condition_image(p) for p in range(len(SPEC.prompts))]
    x0 = torch.randn(len(images), *adapter.latent_shape(SHAPE), generator=torch.Generator().manual_seed(3))
    sigmas, _ = adapter.schedule(4, SHAPE)
    rule = SPEC.cfg_rule if cfg else ("none", 1.0)

    finals = []
    for p, (prompt, image) in enumerate(zip(SPEC.prompts, images, strict=True)):
        texts = {"positive": [prompt], **({"negative": [settings["negative_prompt"]]} if cfg else {})}
        finals.append(adapter_ode(adapter, x0[p : p + 1], texts, [image], 1.0, rule, SHAPE))

    pipe = family_pipeline
    final = pipeline_latents(pipe, SPEC.prompts, images, x0, settings)
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    torch.testing.assert_close(torch.cat(finals), final, atol=1e-5, rtol=0)


@torch.no_grad()
def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline, at_request_size):
    """Over gRPC with true CFG: the stream states the sequence concatenation of image_latents, each
    branch's env holds the pipeline's own image latents and both grids, and from the same x_0
    QwenImageEditPipeline reaches the streamed final latents and images."""
    request = family_request("qwen-image-edit", "ODE", cfg=True, samples_per_prompt=1, images=True)
    trajectories = family_client.rollout(request)
    pipe = family_pipeline
    images = [condition_image(p) for p in range(len(SPEC.prompts))]
    for trajectory, image in zip(trajectories, images, strict=True):
        assert trajectory.transformer_call.conditioning == CONDITIONING
        pixels = pipe.image_processor.preprocess(image, SHAPE.height, SHAPE.width).unsqueeze(2)
        _, image_latents = pipe.prepare_latents(
            pixels, 1, 16, SHAPE.height, SHAPE.width, torch.float32, torch.device("cpu"), None, torch.empty(0)
        )
        for env in trajectory.env.values():
            assert torch.equal(env["image_latents"], image_latents)
            assert env["img_shapes"] == [[[1, 4, 4], [1, 4, 4]]]  # lists, as the stream has them
    x0 = torch.stack([t.latents[0] for t in trajectories])
    final = pipeline_latents(pipe, request.prompts, images, x0, SPEC.cfg_on)
    torch.testing.assert_close(torch.stack([t.latents[-1] for t in trajectories]), final, atol=1e-5, rtol=0)
    latents = pipe._unpack_latents(final, SHAPE.height, SHAPE.width, pipe.vae_scale_factor)
    decoded = pipe.vae.decode(denormalized(pipe.vae, latents), return_dict=False)[0][:, :, 0]
    for trajectory, image in zip(trajectories, pipe.image_processor.postprocess(decoded), strict=True):
        diff = np.asarray(trajectory.image(), dtype=int) - np.asarray(image, dtype=int)
        assert np.abs(diff).max() <= 1  # uint8 rounding of nearly equal latents


def test_a_prompt_is_bounded_by_its_tokens_not_its_characters(family_client, family_pipeline):
    """A prompt within the character limit whose own tokens are above the pipeline's
    tokenizer_max_length (what the adapter sizes a text's env and a forward's text by) is refused
    before the vision-language encoder runs, INVALID_ARGUMENT naming it: 4096 emoji of 4 bytes each
    (a byte-level BPE), 16,384 tokens."""
    prompt = "\U0001f98a" * 4096
    template = family_pipeline.prompt_template_encode
    tokens = len(family_pipeline.tokenizer(template.format(prompt)).input_ids)
    assert tokens - len(family_pipeline.tokenizer(template.format("")).input_ids) > 1024
    request = family_request("qwen-image-edit", "ODE", cfg=False, samples_per_prompt=1, num_steps=1)
    request.prompts[1] = prompt
    violations = refused_rollout(family_client, request)
    assert [violation.field for violation in violations] == ["prompts[1]"]
    assert "above the 1024 this model takes" in violations[0].description
