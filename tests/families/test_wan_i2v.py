"""Wan image-to-video on the tiny-wan-i2v (2.1) preset: a conditioning image's env is
WanImageToVideoPipeline's own (the first-frame mask and latents it concatenates to the channels, the CLIP
image embeddings), and a rollout steps as the pipeline's own loop does, through the adapter and over gRPC,
with CFG on and off; Wan 2.2's two experts without image embeddings too. Server info, replay parity and
SP=2 (the split cuts the video tokens after the channels are concatenated) are in test_contract.py with the
other families.

WanImageToVideoPipeline's own text encoding needs ftfy; the pipeline is given WanPipeline's encoding
of the same texts (the same code, which uses ftfy when it is installed)."""

import json
import shutil

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from support.adapters import adapter_ode
from support.families import FAMILIES, family_request
from support.requests import condition_image

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import LatentConditioning
from rollout_server import families
from rollout_server.errors import UnsupportedModel
from rollout_server.families.base import MediaShape
from rollout_server.families.wan.preset import WAN_PRESET_CONFIGS, wan_transformer

SHAPE = MediaShape(frames=5, height=64, width=64)
CONDITIONING = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_CHANNELS, "condition")
SPEC = FAMILIES["wan-i2v"]
CHANNELS = 16  # the VAE's latent channels; the transformer reads 16 + 4 + 16


@pytest.fixture
def family() -> str:
    return "wan-i2v"


@pytest.fixture(scope="module")
def wan22_folder(family_resources, tmp_path_factory):
    """Wan 2.2 image-to-video's layout (two 36-channel experts, no image encoder: they read no
    image embeddings) on the preset's VAE, text encoder and scheduler."""
    tiny = family_resources.pipeline("wan-i2v")
    cfg = WAN_PRESET_CONFIGS["tiny"]
    in_channels = tiny.transformer.config.in_channels
    folder = tmp_path_factory.mktemp("wan22-i2v")
    WanImageToVideoPipeline(
        tokenizer=tiny.tokenizer,
        text_encoder=tiny.text_encoder,
        vae=tiny.vae,
        scheduler=tiny.scheduler,
        transformer=wan_transformer(cfg, seed=6, in_channels=in_channels),
        transformer_2=wan_transformer(cfg, seed=7, in_channels=in_channels),
        boundary_ratio=0.875,
    ).save_pretrained(folder)
    return folder


@torch.no_grad()
def text_embeds(pipe, text: str) -> torch.Tensor:
    """WanPipeline's encoding of ``text`` with the image-to-video pipeline's text encoder."""
    t2v = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=None, scheduler=None)
    embeds, _ = t2v.encode_prompt(text, do_classifier_free_guidance=False, max_sequence_length=512)
    return embeds


def pipeline_latents(pipe, text, negative, image, x0, sigmas, timesteps, guidance_scale) -> torch.Tensor:
    """WanImageToVideoPipeline's own final latents from ``x0`` (one prompt and its image: the pipeline
    takes one image per call), stepping with Euler over the adapter's sigmas and feeding the
    transformer UniPC's integer timesteps, as served."""
    euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)

    def set_timesteps(num_inference_steps, device=None):
        FlowMatchEulerDiscreteScheduler.set_timesteps(euler, sigmas=sigmas[:-1].tolist(), device=device)
        euler.timesteps = timesteps[:-1].clone()

    euler.set_timesteps = set_timesteps
    unipc, pipe.scheduler = pipe.scheduler, euler
    try:
        return pipe(
            image=image,
            prompt_embeds=text_embeds(pipe, text),
            negative_prompt_embeds=text_embeds(pipe, negative) if guidance_scale > 1 else None,
            latents=x0,
            height=SHAPE.height,
            width=SHAPE.width,
            num_frames=SHAPE.frames,
            num_inference_steps=len(sigmas) - 1,
            guidance_scale=guidance_scale,
            output_type="latent",
        ).frames
    finally:
        pipe.scheduler = unipc


def wan_ode(adapter, prompts, negative, images, x0, guidance_scale) -> torch.Tensor:
    """``adapter_ode`` with Wan's classic CFG: a negative branch when ``guidance_scale`` > 1."""
    texts = {"positive": list(prompts)}
    if guidance_scale > 1:
        texts["negative"] = [negative] * len(images)
    rule = ("true_cfg", guidance_scale) if guidance_scale > 1 else ("none", 1.0)
    return adapter_ode(adapter, x0, texts, images, guidance_scale, rule, SHAPE)


def test_the_adapter_concatenates_on_channels(adapter):
    assert (adapter.family, adapter.conditioning) == ("wan-i2v", CONDITIONING)
    assert adapter.takes_images and not adapter.text_reads_image
    assert adapter.latent_shape(SHAPE) == (CHANNELS, 2, 8, 8)  # the generated channels only
    assert adapter.conditioning_tokens(SHAPE) == 0
    assert adapter.generated_tokens(SHAPE) == adapter.forward_activation(SHAPE)[0] == 2 * 4 * 4
    # The text's 512 UMT5 states and CLIP's 16 patches and class token, per row.
    assert adapter.text_elements() == 512 * 32 + 17 * 32


@torch.no_grad()
def test_env_is_the_pipelines_own(adapter, family_pipeline):
    """What WanImageToVideoPipeline.__call__ feeds its transformer, at 9 frames with CFG: the
    hidden states are cat([x, condition]) with the adapter's condition, bitwise, which follows the
    independent formula (a mask of 4 channels, one per frame of a latent frame, set on the first
    frame only, then the VAE's latent mode of the image followed by 8 black frames, normalised);
    both branches read the adapter's image embeddings and text states."""
    pipe, image = family_pipeline, condition_image(0)
    shape = MediaShape(frames=9, height=64, width=64)
    image_env = adapter.encode_image(image, shape)
    positive, negative = (adapter.encode_text(text, 5.0, shape) for text in ("a red fox", "blurry"))
    assert set(image_env) == {"condition", "encoder_hidden_states_image"}
    assert set(positive) == {"encoder_hidden_states", "attention_kwargs", "return_dict"}

    calls = []
    record = lambda module, args, kwargs: calls.append(kwargs)  # noqa: E731
    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    x0 = torch.randn(1, *adapter.latent_shape(shape), generator=torch.Generator().manual_seed(0))
    try:
        pipe(
            image=image,
            prompt_embeds=text_embeds(pipe, "a red fox"),
            negative_prompt_embeds=text_embeds(pipe, "blurry"),
            latents=x0,
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=1,
            guidance_scale=5.0,
            output_type="latent",
        )
    finally:
        handle.remove()
    assert len(calls) == 2  # the positive branch, then the negative
    for call, text_env in zip(calls, (positive, negative), strict=True):
        assert torch.equal(call["hidden_states"], torch.cat([x0, image_env["condition"]], dim=1))
        assert torch.equal(call["encoder_hidden_states_image"], image_env["encoder_hidden_states_image"])
        assert torch.equal(call["encoder_hidden_states"], text_env["encoder_hidden_states"])
    assert image_env["encoder_hidden_states_image"].shape == (1, 17, 32)

    vae = pipe.vae
    pixels = pipe.video_processor.preprocess(image, height=64, width=64)
    video = torch.cat([pixels.unsqueeze(2), torch.zeros(1, 3, 8, 64, 64)], dim=2)
    stats = (1, CHANNELS, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(stats)
    std = torch.tensor(vae.config.latents_std).view(stats)
    latents = (vae.encode(video).latent_dist.mode() - mean) / std
    mask = torch.zeros(1, 4, 3, 8, 8)
    mask[:, :, 0] = 1
    condition = image_env["condition"]
    assert condition.shape == (1, 4 + CHANNELS, 3, 8, 8) and condition.dtype == torch.float32
    assert torch.equal(condition[:, :4], mask)
    torch.testing.assert_close(condition[:, 4:], latents, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
def test_ode_loop_matches_the_pipeline(adapter, family_pipeline, cfg):
    """The adapter's loop over two prompts, each with its own image, batched: within 1e-5 of
    WanImageToVideoPipeline's own loop, run on each prompt from the same x_0."""
    guidance_scale = SPEC.cfg_on["guidance_scale"] if cfg else 1.0
    images = [condition_image(p) for p in range(len(SPEC.prompts))]
    x0 = torch.randn(len(images), *adapter.latent_shape(SHAPE), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x = wan_ode(adapter, SPEC.prompts, "blurry", images, x0, guidance_scale)
    sigmas, timesteps = adapter.schedule(4, SHAPE)
    for p, (text, image) in enumerate(zip(SPEC.prompts, images, strict=True)):
        final = pipeline_latents(
            family_pipeline, text, "blurry", image, x0[p : p + 1], sigmas, timesteps, guidance_scale
        )
        torch.testing.assert_close(x[p : p + 1], final, atol=1e-5, rtol=0)


def test_wan22_experts_read_no_image_embeddings(wan22_folder, family_pipeline):
    """Wan 2.2's layout: two experts switching at the boundary, the condition concatenated on the
    channels, no image embeddings (None, as the pipeline passes them); the loop matches the
    pipeline's, with CFG."""
    adapter = families.load(wan22_folder, torch.device("cpu"), torch.float32)
    assert list(adapter.experts) == ["transformer", "transformer_2"]
    image = condition_image(1)
    image_env = adapter.encode_image(image, SHAPE)
    assert image_env["encoder_hidden_states_image"] is None
    assert adapter.text_elements() == 512 * 32
    sigmas, timesteps = adapter.schedule(4, SHAPE)
    experts = [adapter.expert_for(float(t)) for t in timesteps[:-1]]
    assert experts == list(FAMILIES["wan2.2"].step_transformers)
    x0 = torch.randn(1, *adapter.latent_shape(SHAPE), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        x = wan_ode(adapter, ["a kite"], "blurry", [image], x0, 5.0)
    pipe = WanImageToVideoPipeline.from_pretrained(wan22_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    final = pipeline_latents(pipe, "a kite", "blurry", image, x0, sigmas, timesteps, 5.0)
    torch.testing.assert_close(x, final, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"expand_timesteps": True}, "not a Gaussian transition"),
        ({"image_encoder": [None, None]}, "no image_encoder"),
    ],
    ids=["expanded-timesteps", "no-image-encoder"],
)
def test_unsupported_layouts_are_refused(family_folder, tmp_path, change, why):
    """Wan 2.2 TI2V's overwrite of the first frame (latent inpainting), and image embeddings without the
    encoder computing them."""
    folder = shutil.copytree(family_folder, tmp_path / "model")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **change}))
    with pytest.raises(UnsupportedModel, match=why):
        families.load(folder, torch.device("cpu"), torch.float32)


@torch.no_grad()
def test_ode_rollout_matches_the_pipeline(adapter, family_client, family_pipeline):
    """Over gRPC with CFG: the stream states the channel concatenation of condition, its env holds
    the adapter's image entries, and from the same x_0 the pipeline reaches the streamed final
    latents."""
    # Euler, the steps of pipeline_latents (the family's default is its pipeline's UniPC).
    solver = {"solver": rollout_pb2.SOLVER_EULER}
    request = family_request("wan-i2v", "ODE", cfg=True, samples_per_prompt=1, **solver)
    trajectories = family_client.rollout(request)
    for p, (trajectory, text) in enumerate(zip(trajectories, SPEC.prompts, strict=True)):
        assert trajectory.transformer_call.conditioning == CONDITIONING
        image_env = adapter.encode_image(condition_image(p), SHAPE)
        for env in trajectory.env.values():
            assert torch.equal(env["condition"], image_env["condition"])
            assert torch.equal(env["encoder_hidden_states_image"], image_env["encoder_hidden_states_image"])
        final = pipeline_latents(
            family_pipeline,
            text,
            request.negative_prompt,
            condition_image(p),
            trajectory.latents[:1],
            trajectory.sigmas,
            trajectory.timesteps,
            request.guidance_scale,
        )
        torch.testing.assert_close(trajectory.latents[-1:], final, atol=1e-5, rtol=0)
