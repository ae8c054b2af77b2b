"""Several latent streams per sample (LTX-2's video and audio), without a model: the joint latent's
layout, the noise rule written out from its words, the joint and per-stream log-probs against a float64
reference, the transformer call that cuts and rejoins the streams, the saved trajectory, and the WAV."""

import io
import math
import wave

import numpy as np
import pytest
import torch

from rollout.v1 import rollout_pb2
from rollout_client.trajectory import Trajectory
from rollout_core import latent_streams, noise, steps
from rollout_core.latent_streams import LatentStream
from rollout_core.transformer_call import CallForm, TransformerCall, call_transformer
from rollout_server.families.base import Sound
from rollout_server.stream import wav_bytes

STREAMS = (
    LatentStream("video", (6, 4), "hidden_states"),
    LatentStream("audio", (5, 3), "audio_hidden_states"),
)
SEEDS = [7, 2**64 - 1, 123456789]
MASK = 2**64 - 1


def splitmix64(value: int) -> int:
    """SplitMix64 (Steele, Lea and Flood, 2014), from the paper's constants: not the library's."""
    z = (value + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def documented_draw(seed: int, j: int, stream: int, shape) -> torch.Tensor:
    """Noise stream j of latent stream ``stream``, from the rule's words alone."""
    generator = torch.Generator("cpu").manual_seed(splitmix64(seed ^ splitmix64(j + stream * 2**32)))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def test_the_joint_latent_is_the_streams_flattened_in_order():
    x = torch.arange(2 * 39, dtype=torch.float32).reshape(2, 39)
    assert latent_streams.joint_shape(STREAMS) == (39,)
    video, audio = latent_streams.split(x, STREAMS)
    assert video.shape == (2, 6, 4) and audio.shape == (2, 5, 3)
    assert torch.equal(video[1].flatten(), x[1, :24]) and torch.equal(audio[1].flatten(), x[1, 24:])
    assert torch.equal(latent_streams.join([video, audio]), x)


@pytest.mark.parametrize("j", [0, 1, 5])
def test_each_stream_draws_its_own_noise_by_the_documented_rule(j):
    joint = noise.draw(SEEDS, j, latent_streams.joint_shape(STREAMS), STREAMS)
    for row, seed in enumerate(SEEDS):
        video = documented_draw(seed, j, 0, (6, 4))
        audio = documented_draw(seed, j, 1, (5, 3))
        assert torch.equal(joint[row], torch.cat([video.flatten(), audio.flatten()]))
    # Stream 0 draws what a one-stream family draws at its shape: that rule is unchanged.
    assert torch.equal(joint[:, :24].reshape(3, 6, 4), noise.draw(SEEDS, j, (6, 4)))
    assert "j + k * 2**32" in noise.STREAMS_RULE


def test_the_joint_log_prob_is_the_mean_over_both_streams_and_each_streams_is_its_own():
    """float64 reference: the per-element Gaussian log-density averaged over each stream and over all
    elements, so joint = (24 lp_video + 15 lp_audio) / 39. float32 means of 39 and fewer terms of
    magnitude ~10 round to within 39 ulp(10) ~ 4e-5 of the float64 value: asserted at 1e-4."""
    generator = torch.Generator().manual_seed(0)
    residual = torch.randn(3, 39, generator=generator) * 0.3
    sd = torch.tensor(0.25)
    joint = steps.log_prob(residual, sd, include_constants=True)
    per_stream = steps.stream_log_probs(residual, sd, True, STREAMS)
    r = residual.double().numpy()
    density = -(r**2) / (2 * 0.25**2) - math.log(0.25) - math.log(math.sqrt(2 * math.pi))
    np.testing.assert_allclose(joint.numpy(), density.mean(1), atol=1e-4, rtol=0)
    np.testing.assert_allclose(per_stream["video"].numpy(), density[:, :24].mean(1), atol=1e-4, rtol=0)
    np.testing.assert_allclose(per_stream["audio"].numpy(), density[:, 24:].mean(1), atol=1e-4, rtol=0)
    weighted = (24 * per_stream["video"].double() + 15 * per_stream["audio"].double()) / 39
    np.testing.assert_allclose(joint.numpy(), weighted.numpy(), atol=1e-4, rtol=0)


class TwoStreams(torch.nn.Module):
    """A transformer of two streams: each output a function of both inputs, the timestep and sigma."""

    def forward(self, hidden_states, audio_hidden_states, timestep, sigma, scale, return_dict=False):
        assert hidden_states.shape[1:] == (6, 4) and audio_hidden_states.shape[1:] == (5, 3)
        assert torch.equal(timestep, sigma)
        cross = audio_hidden_states.sum((1, 2))[:, None, None]
        video = scale * hidden_states + cross + timestep[:, None, None]
        audio = 2 * audio_hidden_states - hidden_states.mean((1, 2))[:, None, None]
        return video, audio


def test_the_call_cuts_the_joint_latent_into_its_streams_and_joins_the_outputs():
    x = torch.randn(2, 39, generator=torch.Generator().manual_seed(1))
    form = CallForm(timestep_float32=True, timestep_copies=("sigma",), streams=STREAMS)
    v = call_transformer(
        TwoStreams(), x, torch.tensor([3.0, 5.0]), {"scale": 0.5}, torch.float32, 1.0, form=form
    )
    video, audio = x[:, :24].reshape(2, 6, 4), x[:, 24:].reshape(2, 5, 3)
    expected_video = 0.5 * video + audio.sum((1, 2))[:, None, None] + torch.tensor([3.0, 5.0])[:, None, None]
    expected_audio = 2 * audio - video.mean((1, 2))[:, None, None]
    assert torch.equal(v, torch.cat([expected_video.flatten(1), expected_audio.flatten(1)], dim=1))


def test_the_streams_travel_in_the_transformer_call():
    form = CallForm(timestep_float32=True, timestep_copies=("sigma",), streams=STREAMS)
    call = TransformerCall(
        "LTX2VideoTransformer3DModel", "float32", 1.0, "t", "true_cfg", 3.0, ("positive",), (), form=form
    )
    message = call.to_proto()
    assert [(s.name, list(s.shape), s.argument) for s in message.streams] == [
        ("video", [6, 4], "hidden_states"),
        ("audio", [5, 3], "audio_hidden_states"),
    ]
    assert list(message.timestep_copies) == ["sigma"]
    assert TransformerCall.from_proto(message) == call
    assert TransformerCall.from_json(call.to_json()) == call
    # A one-stream family's call sets neither field: its bytes are those of servers before them.
    plain = TransformerCall("WanTransformer3DModel", "float32", 1.0, "t", "true_cfg", 5.0, ("positive",), ())
    assert not plain.to_proto().streams and not plain.to_proto().timestep_copies
    with pytest.raises(ValueError, match="latent streams take neither"):
        call_transformer(
            TwoStreams(),
            torch.zeros(1, 39),
            1.0,
            {},
            torch.float32,
            1.0,
            form=CallForm(inputs=rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES, streams=STREAMS),
        )


def test_a_saved_trajectory_keeps_its_streams_log_probs_and_sound(tmp_path):
    form = CallForm(streams=STREAMS)
    trajectory = Trajectory(
        request_id="r",
        sample_index=0,
        prompt_index=0,
        prompt="a drum",
        seed=7,
        sampler_type="FLOW_SDE",
        noise_level=0.7,
        log_prob_constants=True,
        sigmas=torch.tensor([1.0, 0.5, 0.0]),
        timesteps=torch.tensor([1000.0, 500.0, 0.0]),
        stochastic=torch.tensor([True, False]),
        latents=torch.randn(3, 39),
        latent_mask=torch.ones(3, dtype=torch.bool),
        log_probs=torch.tensor([-1.5, float("nan")]),
        env={"positive": {}},
        transformer_call=TransformerCall("T", "float32", 1.0, "t", "none", 1.0, ("positive",), (), form=form),
        policy_version=0,
        stream_log_probs={
            "video": torch.tensor([-1.0, float("nan")]),
            "audio": torch.tensor([-2.3, float("nan")]),
        },
        audio_wav=b"RIFF....WAVE",
    )
    assert trajectory.stream_latents("audio").shape == (3, 5, 3)
    assert torch.equal(trajectory.stream_latents("audio")[2].flatten(), trajectory.latents[2, 24:])
    trajectory.save(tmp_path / "t.safetensors")
    loaded = Trajectory.load(tmp_path / "t.safetensors")
    assert loaded.streams == STREAMS and loaded.audio_wav == b"RIFF....WAVE"
    assert loaded.stream_log_probs.keys() == {"video", "audio"}
    for name, values in trajectory.stream_log_probs.items():
        assert torch.equal(loaded.stream_log_probs[name].nan_to_num(), values.nan_to_num())


def test_the_wav_is_16_bit_pcm_of_the_waveform():
    rate, seconds = 24000, 0.25
    t = torch.arange(int(rate * seconds)) / rate
    waveform = torch.stack([0.5 * torch.sin(2 * math.pi * 440 * t), torch.full_like(t, 2.0)])  # clipped
    with wave.open(io.BytesIO(wav_bytes(Sound(waveform, rate)))) as reader:
        assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate()) == (2, 2, rate)
        assert reader.getnframes() == len(t)
        pcm = np.frombuffer(reader.readframes(len(t)), dtype="<i2").reshape(-1, 2)
    np.testing.assert_array_equal(pcm[:, 0], np.round(waveform[0].numpy() * 32767).astype(np.int16))
    assert (pcm[:, 1] == 32767).all()
