"""LTX-2 text-to-video with sound on the tiny-ltx2 preset: a sample's video and audio latents are two
streams of one joint latent; each stream's noise comes from the sample's seed by the documented rule;
every stochastic step's joint log-prob is the mean over both streams' elements, each stream's own
streamed beside it; the ODE is LTX2Pipeline's own from the same noise, video and audio; the frames
and the sound are decoded as the pipeline decodes them, the sound into a WAV a person can play.
Server info, replay parity (client and bare reference), frame bounds (8k + 1) and SP=2 are in
test_contract.py with the other families."""

import csv
import io
import math
import wave

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.adapters import video_and_audio
from support.errors import refused_rollout
from support.families import family_request
from support.parity import TOLERANCE
from support.servers import http_url, run_example, start_server
from test_latent_streams import documented_draw

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, replay_stream_log_probs
from rollout_client.commands import save_rollout
from rollout_core import latent_streams, noise, wire

EPS, MEAN = rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_MEAN
FRAMES = 9  # the preset's: 2 latent frames of 2 x 2 tokens, 9 latent audio frames
# A float32 per-sample log-prob against its float64 value: each element's density (a square over sd^2,
# a log, sums: terms below 10 in magnitude here) rounds to within a few u of 10, and torch's CPU sum
# reduces the at most 1312 terms pairwise, within about log2(1312) ~ 11 u of their magnitude: below
# 1e-5 in all. 4e-5 leaves the margin for a CPU that vectorises the sum in other lanes.
LOG_PROB_BOUND = 4e-5
# 8-bit frames decoded in two processes (the server a sample at a time, the test both in one batch):
# the pixels differ by float32 rounding, far below half an 8-bit step, so a value rounds to the same
# byte or, where it sits on a rounding boundary, to the next one.
ONE_BYTE = 1


@pytest.fixture
def family() -> str:
    return "ltx2"


@pytest.mark.parametrize(("side", "message"), [(48, "a multiple of 32"), (32, "at least 64 pixels")])
def test_a_side_off_the_32_pixel_grid_or_below_two_latents_is_refused(family_client, side, message):
    """The video decoder's reflect padding needs 2 x 2 latents: 32 pixels would fail at the decode."""
    violations = refused_rollout(family_client, family_request("ltx2", "ODE", cfg=False, height=side))
    assert [violation.field for violation in violations] == ["height"]
    assert message in violations[0].description


def test_health_generate_probes_at_the_smallest_size_the_model_takes(family_resources):
    """/health_generate's rollout is at ``limits.min_side``: LTX-2's one side multiple, 32 pixels,
    would be refused."""
    server = family_resources.server("ltx2")
    assert httpx.get(f"{http_url(server)}/health_generate", timeout=120).status_code == 200


def test_both_streams_noise_and_the_joint_log_prob_follow_the_documented_rules(family_client):
    """x_0 and each step's eps: video and audio each drawn at its own shape from the seed by the
    rule's words (test_latent_streams.documented_draw, latent stream 1 for the audio), x' = mean +
    sd eps, and the step's joint log-prob the mean over all 1312 elements in float64 of the streamed
    bytes, each stream's own log-prob the same over its elements, their element-weighted mean the
    joint one (LOG_PROB_BOUND)."""
    request = family_request("ltx2", "FLOW_SDE", cfg=True, debug_tensors=[EPS, MEAN])
    events = list(family_client.stream(request))
    started = events[0]
    streams = [(s.name, tuple(s.shape), s.argument) for s in started.message.transformer_call.streams]
    assert streams == [("video", (8, 128), "hidden_states"), ("audio", (9, 32), "audio_hidden_states")]
    assert list(started.message.transformer_call.timestep_copies) == ["sigma"]
    assert started.message.noise_rule == noise.NOISE_RULE + noise.STREAMS_RULE
    seeds = list(started.message.seeds)
    for j, x in [(0, started.x0)] + [(step.index + 1, step.debug["eps"]) for step in events[1:5]]:
        for row, seed in enumerate(seeds):
            video = documented_draw(seed, j, 0, (8, 128))
            audio = documented_draw(seed, j, 1, (9, 32))
            assert torch.equal(x[row], torch.cat([video.flatten(), audio.flatten()]))
    x_i = started.x0
    for step in events[1:5]:
        sd = step.message.noise_std
        # The server's float32 x' = mean + sd * eps, the same two operations on the streamed bytes.
        assert torch.equal(step.x_next, step.debug["mean"] + sd * step.debug["eps"])
        residual = (step.x_next.double() - step.debug["mean"].double()).numpy()
        density = -(residual**2) / (2 * sd**2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))
        np.testing.assert_allclose(step.log_probs.numpy(), density.mean(1), atol=LOG_PROB_BOUND, rtol=0)
        per_stream = step.stream_log_probs
        assert per_stream.keys() == {"video", "audio"}
        np.testing.assert_allclose(
            per_stream["video"].numpy(), density[:, :1024].mean(1), atol=LOG_PROB_BOUND, rtol=0
        )
        np.testing.assert_allclose(
            per_stream["audio"].numpy(), density[:, 1024:].mean(1), atol=LOG_PROB_BOUND, rtol=0
        )
        weighted = (1024 * per_stream["video"].double() + 288 * per_stream["audio"].double()) / 1312
        np.testing.assert_allclose(step.log_probs.numpy(), weighted.numpy(), atol=LOG_PROB_BOUND, rtol=0)
        assert not torch.equal(step.x_next, x_i)
        x_i = step.x_next


@pytest.mark.parametrize("cfg", [True, False])
def test_ode_rollout_matches_the_pipeline(family_client, family_pipeline, cfg):
    """Schedule (linspace(1, 1/N, N) shifted by mu of the video tokens, shift_terminal), the Gemma 3
    encoding through the connectors, the rotary coordinates, the raw timestep as timestep and sigma and
    CFG on both streams: from the same x_0, LTX2Pipeline's own ``__call__`` (its other guidance terms
    off, the audio scale following the video one) reaches the streamed final latents of both streams.
    The pipeline guides in x0 space (x - sigma v) and the server on velocities: the same number up to
    float32 rounding of the conversions, TOLERANCE in v, times up to 2s - 1 = 5 at scale 3 with CFG."""
    request = family_request("ltx2", "ODE", cfg=cfg, samples_per_prompt=1)
    trajectories = family_client.rollout(request)
    pipe, streams = family_pipeline, trajectories[0].streams
    x0 = latent_streams.split(torch.stack([t.latents[0] for t in trajectories]), streams)
    video, audio = pipe(
        prompt=list(request.prompts),
        negative_prompt=[request.negative_prompt] * len(request.prompts) if cfg else None,
        latents=x0[0],
        # The pipeline normalises given audio latents: the preset's audio mean 0 and std 1 keep them.
        audio_latents=x0[1],
        height=64,
        width=64,
        num_frames=FRAMES,
        num_inference_steps=4,
        # The audio scales follow the video ones where None (the pipeline's ``audio_x or x``).
        guidance_scale=request.guidance_scale,
        audio_guidance_scale=None,
        stg_scale=0.0,
        audio_stg_scale=None,
        modality_scale=1.0,
        audio_modality_scale=None,
        guidance_rescale=0.0,
        audio_guidance_rescale=None,
        output_type="latent",
        return_dict=False,
    )
    assert torch.equal(pipe.audio_vae.latents_mean, torch.zeros(32))
    assert torch.equal(pipe.audio_vae.latents_std, torch.ones(32))
    np.testing.assert_array_equal(trajectories[0].sigmas[:-1].numpy(), pipe.scheduler.sigmas[:-1].numpy())
    served_video, served_audio = video_and_audio(
        pipe, torch.stack([t.latents[-1] for t in trajectories]), streams
    )
    bound = (2 * request.guidance_scale - 1) * TOLERANCE if cfg else TOLERANCE
    torch.testing.assert_close(video, served_video, atol=bound, rtol=bound)
    torch.testing.assert_close(audio, served_audio, atol=bound, rtol=bound)


def test_frames_and_a_playable_wav_per_sample_as_the_pipeline_decodes_them(
    family_client, family_pipeline, tmp_path
):
    request = family_request("ltx2", "FLOW_SDE", cfg=False, images=True)
    events = list(family_client.stream(request))
    trajectories = save_rollout(tmp_path, events)
    pipe = family_pipeline
    final = torch.stack([t.latents[-1] for t in trajectories])
    video, audio = video_and_audio(pipe, final, trajectories[0].streams)
    with torch.no_grad():
        pixels = pipe.vae.decode(video, None, return_dict=False)[0]
        waveforms = pipe.vocoder(pipe.audio_vae.decode(audio, return_dict=False)[0])
    expected_frames = pipe.video_processor.postprocess_video(pixels, output_type="np")  # [B, F, H, W, 3]
    rate = pipe.vocoder.config.output_sampling_rate
    for k, trajectory in enumerate(trajectories):
        frames = np.stack(
            [np.asarray(frame.convert("RGB"), dtype=np.float64) for frame in trajectory.frames()]
        )
        assert frames.shape == (FRAMES, 64, 64, 3)
        np.testing.assert_allclose(frames, np.round(expected_frames[k] * 255), atol=ONE_BYTE)
        wav_file = tmp_path / f"sample-{trajectory.sample_index}.wav"
        assert wav_file.read_bytes() == trajectory.audio_wav
        with wave.open(io.BytesIO(trajectory.audio_wav)) as reader:
            assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (rate, 2, 2)
            samples = reader.getnframes()
            pcm = np.frombuffer(reader.readframes(samples), dtype="<i2").reshape(samples, 2)
        # The vocoder's 240 samples per mel frame of the audio VAE's 4 L - 3: 33 frames, 0.33 s of sound
        # beside 9 / 24 = 0.375 s of video at 24 kHz.
        assert samples == waveforms.shape[-1] == (4 * 9 - 3) * 240
        expected_pcm = np.round(np.clip(waveforms[k].numpy().T, -1, 1) * 32767)
        # The same argument for 16-bit PCM: float32 rounding far below half a step of 1 / 32767.
        np.testing.assert_allclose(pcm, expected_pcm, atol=ONE_BYTE)
        assert pcm.std() > 0  # not silence


def test_a_trainers_x0_is_the_joint_latent_and_anything_else_is_refused(family_client):
    """``initial_latents`` holds the joint latents [B, N]: a rollout from the x_0 another one streamed
    streams the same x_0 and, with the same seeds, the same steps bitwise; the video stream alone, the
    streams side by side or a joint latent of another frame count are INVALID_ARGUMENT naming it."""
    first = family_client.rollout(family_request("ltx2", "FLOW_SDE", cfg=False))
    x0 = torch.stack([t.latents[0] for t in first])
    again = family_client.rollout(
        family_request("ltx2", "FLOW_SDE", cfg=False, initial_latents=wire.initial_latents_bytes(x0))
    )
    for one, two in zip(first, again, strict=True):
        assert torch.equal(one.latents, two.latents) and torch.equal(
            one.log_probs.nan_to_num(), two.log_probs.nan_to_num()
        )
    video = latent_streams.split(x0, first[0].streams)[0]
    for wrong in (video, torch.stack([x0, x0], dim=1), torch.zeros(4, 8 * 128 * 2 + 9 * 32)):
        request = family_request(
            "ltx2", "FLOW_SDE", cfg=False, initial_latents=wire.initial_latents_bytes(wrong)
        )
        violations = refused_rollout(family_client, request)
        assert [violation.field for violation in violations] == ["initial_latents"]


def test_flowgrpo_and_nft_train_on_the_joint_latents_on_policy(cache_dir, tmp_path):
    """The trainer on LTX-2 (a server of its own: the runs push their policy): FlowGRPO replays each
    step's joint log-prob through its LoRA policy with a ratio of 1 up to fp32 replay error at the first
    inner update (TOLERANCE), the LoRA it pushes changes both streams of the next rollouts; DiffusionNFT
    trains its velocity loss on the joint latents."""
    server = start_server(cache_dir, tmp_path / "server.log", "--model", "tiny-ltx2")
    try:
        common = ["--server", server.address, "--iterations", "2", "--prompts", "2", "--group-size", "2"]
        common += ["--steps", "3", "--size", "64"]  # the family's default LoRA targets
        with RolloutClient(server.address, timeout=120) as client:
            probe = family_request("ltx2", "FLOW_SDE", cfg=False, samples_per_prompt=1, num_steps=3)
            before = client.rollout(probe)
            run_example("train_grpo", *common, "--out", tmp_path / "grpo")
            after = client.rollout(probe)
            run_example("train_grpo", *common, "--algorithm", "nft", "--out", tmp_path / "nft")
    finally:
        server.stop()
    for run in ("grpo", "nft"):
        with open(tmp_path / run / "metrics.csv") as file:
            rows = list(csv.DictReader(file))
        assert [int(row["iteration"]) for row in rows] == [0, 1]
        if run == "grpo":
            assert all(float(row["ratio_max_dev"]) <= TOLERANCE for row in rows)
        adapter = load_file(tmp_path / run / "lora" / "adapter_model.safetensors")
        assert any(tensor.abs().max() > 0 for name, tensor in adapter.items() if "lora_B" in name)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.latents[0], new.latents[0])  # the same noise
        for stream in old.streams:
            moved = old.stream_latents(stream.name)[-1] - new.stream_latents(stream.name)[-1]
            assert moved.abs().max() > 1e-4, stream.name


@pytest.mark.parametrize("sampler", ["FLOW_SDE", "CPS"])
def test_each_streams_log_prob_replays_as_streamed(family_client, family_transformer, sampler):
    """``replay_stream_log_probs``: each stream's own log-prob of every stochastic step, recomputed
    through the transformer, within TOLERANCE of the streamed one (the Replay row of docs/testing.md)."""
    for trajectory in family_client.rollout(family_request("ltx2", sampler, cfg=True)):
        replayed = replay_stream_log_probs(family_transformer, trajectory)
        assert replayed.keys() == trajectory.stream_log_probs.keys() == {"video", "audio"}
        for name, values in replayed.items():
            np.testing.assert_allclose(
                values.numpy(),
                trajectory.stream_log_probs[name].numpy(),
                atol=TOLERANCE,
                rtol=0,
                equal_nan=True,
            )
            assert torch.isfinite(values[trajectory.stochastic]).all()
