"""The SD3 family over gRPC on the tiny-sd3 preset: detection, server info, the pipeline's own schedule
and sampling, and replay parity (docs/design.md, invariant 1) with SD3's classic CFG on and off.

SD3 differs from Flux in every convention a trainer replays with: unpacked [C, H/8, W/8] latents, the raw
timestep (no / 1000), a static-shift schedule, and CFG driven by ``guidance_scale`` with the negative
prompt as its own env branch.
"""

import numpy as np
import pytest
import reference
import torch
from conftest import start_server
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, replay_log_probs
from rollout_server import families
from rollout_server.presets import resolve_model

SAMPLERS = {"FLOW_SDE": rollout_pb2.SAMPLER_TYPE_FLOW_SDE, "CPS": rollout_pb2.SAMPLER_TYPE_CPS}
TOLERANCE = 1e-5
ENV_KEYS = {"encoder_hidden_states", "pooled_projections", "joint_attention_kwargs", "return_dict"}


@pytest.fixture(scope="module")
def sd3_folder(cache_dir):
    return resolve_model("tiny-sd3", cache_dir)


@pytest.fixture(scope="module")
def sd3_client(sd3_folder, cache_dir, tmp_path_factory):
    server = start_server(cache_dir, tmp_path_factory.mktemp("sd3") / "server.log", "--model", "tiny-sd3")
    with RolloutClient(server.address, timeout=300) as client:
        yield client
    server.stop()


@pytest.fixture(scope="module")
def sd3_transformer(sd3_folder):
    """The tiny transformer, loaded the trainer's way: plain diffusers from_pretrained."""
    return SD3Transformer2DModel.from_pretrained(sd3_folder / "transformer").eval()


def sd3_request(sampler: int, cfg: bool) -> rollout_pb2.RolloutRequest:
    request = rollout_pb2.RolloutRequest(
        prompts=["a red fox in the snow", "two cats"],
        samples_per_prompt=2,
        base_seed=21,
        height=64,
        width=64,
        num_steps=4,
        sampler=sampler,
        guidance_scale=4.5 if cfg else 1.0,
        images=False,
    )
    if cfg:
        request.negative_prompt = "blurry"
    return request


def test_folder_is_detected_as_sd3(sd3_folder):
    assert families.detect(sd3_folder).family == "sd3"


def test_server_info(sd3_client):
    info = sd3_client.server_info()
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


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_streamed_log_probs_replay(sd3_client, sd3_transformer, sampler, cfg):
    trajectories = sd3_client.rollout(sd3_request(SAMPLERS[sampler], cfg))
    assert len(trajectories) == 4
    for trajectory in trajectories:
        call = trajectory.transformer_call
        assert call["timestep_divisor"] == 1.0
        assert (call["guidance_rule"], call["guidance_rule_scale"]) == (
            ("true_cfg", 4.5) if cfg else ("none", 1.0)
        )
        assert set(trajectory.env) == ({"positive", "negative"} if cfg else {"positive"})
        for env in trajectory.env.values():
            assert set(env) == ENV_KEYS
            assert env["encoder_hidden_states"].shape[::2] == (1, sd3_transformer.config.joint_attention_dim)
            assert env["pooled_projections"].shape == (1, sd3_transformer.config.pooled_projection_dim)
        assert trajectory.latents.shape == (5, 16, 8, 8)
        # CPS's last step goes into sigma_T = 0 with sd = 0: deterministic, not scored.
        assert trajectory.stochastic.tolist() == (
            [True, True, True, False] if sampler == "CPS" else [True] * 4
        )

        streamed = trajectory.log_probs
        replayed = replay_log_probs(sd3_transformer, trajectory)
        np.testing.assert_allclose(replayed.numpy(), streamed.numpy(), atol=TOLERANCE, rtol=0, equal_nan=True)
        bare = reference.bare_log_probs(sd3_transformer, trajectory)
        assert bare.keys() == set(torch.nonzero(trajectory.stochastic).flatten().tolist())
        for i, value in bare.items():
            assert abs(value - streamed[i].item()) <= TOLERANCE, (i, value, streamed[i].item())


def test_ode_rollout_matches_the_pipeline(sd3_client, sd3_folder):
    """Schedule, env, raw timestep and CFG all as StableDiffusion3Pipeline: from the same x_0, its own
    sampling loop reaches the streamed final latents."""
    request = sd3_request(rollout_pb2.SAMPLER_TYPE_ODE, cfg=True)
    request.samples_per_prompt = 1
    trajectories = sd3_client.rollout(request)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
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
