"""The Qwen-Image family over gRPC on the tiny-qwen-image preset: detection, server info, the pipeline's own
schedule and sampling, per-prompt conditioning lengths and replay parity (docs/design.md)
with true CFG (norm rescale) on and off.

Qwen-Image's env differs from Flux's where SGLang-Diffusion's users got hurt: every prompt has its own text
length, so a request mixing prompt lengths must give each sample the env of its own prompt, unpadded.
"""

import numpy as np
import pytest
import reference
import torch
from conftest import start_server
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, replay_log_probs
from rollout_server import families
from rollout_server.families.qwen_image import QwenImageAdapter
from rollout_server.presets import resolve_model

SAMPLERS = {"FLOW_SDE": rollout_pb2.SAMPLER_TYPE_FLOW_SDE, "CPS": rollout_pb2.SAMPLER_TYPE_CPS}
TOLERANCE = 1e-5
SHORT_PROMPT = "a fox"
LONG_PROMPT = "A cozy cabin in the mountains covered with fresh snow, warm light in the windows."
NEGATIVE_PROMPT = "blurry"
ENV_KEYS = {
    "encoder_hidden_states",
    "encoder_hidden_states_mask",
    "img_shapes",
    "guidance",
    "attention_kwargs",
    "return_dict",
}


@pytest.fixture(scope="module")
def qwen_folder(cache_dir):
    return resolve_model("tiny-qwen-image", cache_dir)


@pytest.fixture(scope="module")
def qwen_client(qwen_folder, cache_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen-image") / "server.log"
    server = start_server(cache_dir, log, "--model", "tiny-qwen-image")
    with RolloutClient(server.address, timeout=300) as client:
        yield client
    server.stop()


@pytest.fixture(scope="module")
def qwen_transformer(qwen_folder):
    """The tiny transformer, loaded the trainer's way: plain diffusers from_pretrained."""
    return QwenImageTransformer2DModel.from_pretrained(qwen_folder / "transformer").eval()


@pytest.fixture(scope="module")
def qwen_pipe(qwen_folder):
    pipe = QwenImagePipeline.from_pretrained(qwen_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def text_length(pipe: QwenImagePipeline, prompt: str) -> int:
    """The prompt's token count after the pipeline drops the template's system prefix."""
    tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt)).input_ids
    return len(tokens) - pipe.prompt_template_encode_start_idx


def qwen_request(sampler: int, cfg: bool) -> rollout_pb2.RolloutRequest:
    request = rollout_pb2.RolloutRequest(
        prompts=[SHORT_PROMPT, LONG_PROMPT],
        samples_per_prompt=2,
        base_seed=31,
        height=64,
        width=64,
        num_steps=4,
        sampler=sampler,
        true_cfg_scale=4.0 if cfg else 1.0,
        images=False,
    )
    if cfg:
        request.negative_prompt = NEGATIVE_PROMPT
    return request


def test_folder_is_detected_as_qwen_image(qwen_folder):
    assert families.detect(qwen_folder) is QwenImageAdapter


def test_server_info(qwen_client):
    info = qwen_client.server_info()
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


def test_template_prefix_is_dropped_exactly(qwen_pipe):
    """As with Qwen2's real vocabulary, the pipeline's fixed drop count removes exactly the system prefix:
    what is left is the prompt's own tokens and the template's closing ones, even for a one-word prompt."""
    prefix, suffix = qwen_pipe.prompt_template_encode.split("{}")
    tokenizer = qwen_pipe.tokenizer
    assert len(tokenizer(prefix).input_ids) == qwen_pipe.prompt_template_encode_start_idx
    for prompt in ("fox", SHORT_PROMPT, LONG_PROMPT):
        expected = len(tokenizer(prompt).input_ids) + len(tokenizer(suffix).input_ids)
        assert text_length(qwen_pipe, prompt) == expected, prompt


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_streamed_log_probs_replay(qwen_client, qwen_transformer, qwen_pipe, sampler, cfg):
    """Two prompts of different lengths in one request: each sample's env has its own prompt's length,
    unpadded, and replays its own sample."""
    trajectories = qwen_client.rollout(qwen_request(SAMPLERS[sampler], cfg))
    assert [t.prompt_index for t in trajectories] == [0, 0, 1, 1]
    short, long = text_length(qwen_pipe, SHORT_PROMPT), text_length(qwen_pipe, LONG_PROMPT)
    assert short < long
    for trajectory in trajectories:
        call = trajectory.transformer_call
        assert call["timestep_divisor"] == 1000.0
        assert (call["guidance_rule"], call["guidance_rule_scale"]) == (
            ("true_cfg_norm_rescale", 4.0) if cfg else ("none", 1.0)
        )
        assert set(trajectory.env) == ({"positive", "negative"} if cfg else {"positive"})
        lengths = {"positive": (short, long)[trajectory.prompt_index]}
        if cfg:
            lengths["negative"] = text_length(qwen_pipe, NEGATIVE_PROMPT)
        for branch, env in trajectory.env.items():
            assert set(env) == ENV_KEYS
            assert env["encoder_hidden_states"].shape == (
                1,
                lengths[branch],
                qwen_transformer.config.joint_attention_dim,
            )
            # One unpadded prompt per env: QwenImagePipeline passes no mask then, and no guidance.
            assert env["encoder_hidden_states_mask"] is None and env["guidance"] is None
            assert env["img_shapes"] == [[[1, 4, 4]]]  # one sample, one frame, a 4x4 patch grid
            assert env["attention_kwargs"] == {} and env["return_dict"] is False
        assert trajectory.latents.shape == (5, 16, 4 * 16)
        # CPS's last step goes into sigma_T = 0 with sd = 0: deterministic, not scored.
        assert trajectory.stochastic.tolist() == (
            [True, True, True, False] if sampler == "CPS" else [True] * 4
        )

        streamed = trajectory.log_probs
        replayed = replay_log_probs(qwen_transformer, trajectory)
        np.testing.assert_allclose(replayed.numpy(), streamed.numpy(), atol=TOLERANCE, rtol=0, equal_nan=True)
        bare = reference.bare_log_probs(qwen_transformer, trajectory)
        assert bare.keys() == set(torch.nonzero(trajectory.stochastic).flatten().tolist())
        for i, value in bare.items():
            assert abs(value - streamed[i].item()) <= TOLERANCE, (i, value, streamed[i].item())

    # Distinct samples of a group are scored separately (docs/design.md), and the env matters: the long
    # prompt's env does not replay a short-prompt sample.
    assert not torch.equal(trajectories[0].log_probs, trajectories[1].log_probs)
    trajectories[0].env = trajectories[2].env
    mismatch = replay_log_probs(qwen_transformer, trajectories[0]) - trajectories[0].log_probs
    assert mismatch.nan_to_num().abs().max() > TOLERANCE


def test_ode_rollout_matches_the_pipeline(qwen_client, qwen_pipe):
    """Schedule, env, timestep / 1000, true CFG with norm rescale and decoding all as QwenImagePipeline:
    from the same x_0, its own loop (a padded, masked batch of both prompts) reaches the streamed final
    latents and images."""
    request = qwen_request(rollout_pb2.SAMPLER_TYPE_ODE, cfg=True)
    request.samples_per_prompt = 1
    request.images = True
    trajectories = qwen_client.rollout(request)
    latents = []

    def record_latents(pipe, step, timestep, tensors):
        latents.append(tensors["latents"])
        return {}

    images = qwen_pipe(
        prompt=list(request.prompts),
        negative_prompt=request.negative_prompt,
        true_cfg_scale=request.true_cfg_scale,
        latents=torch.stack([t.latents[0] for t in trajectories]),
        height=64,
        width=64,
        num_inference_steps=4,
        callback_on_step_end=record_latents,
    ).images
    np.testing.assert_array_equal(trajectories[0].sigmas.numpy(), qwen_pipe.scheduler.sigmas.numpy())
    np.testing.assert_array_equal(
        trajectories[0].timesteps[:-1].numpy(), qwen_pipe.scheduler.timesteps.numpy()
    )
    streamed = torch.stack([t.latents[-1] for t in trajectories])
    torch.testing.assert_close(latents[-1], streamed, atol=1e-5, rtol=0)
    for trajectory, image in zip(trajectories, images, strict=True):
        assert trajectory.image().size == (64, 64)
        diff = np.asarray(trajectory.image(), dtype=int) - np.asarray(image, dtype=int)
        assert np.abs(diff).max() <= 1  # uint8 rounding of nearly equal latents
