"""Previews (``RolloutRequest.preview_steps``): at each chosen step every row that took it streams its
x0_hat = x_i - sigma_i v_i decoded as the final images are. Each preview is checked against the
pipeline's own decode (its VAE, its image or video processor, LTX-2's vocoder) of x0_hat computed here
from the streamed x_i, sigma_i and guided velocity; in a tree each node's against its own.

Bitwise by "Same path" (docs/testing.md): x_i and the velocity are the streamed float32 bytes, and
``rollout_core.solvers.data_prediction`` the server's own elementwise arithmetic, so x0_hat is the
server's to the bit; the reference decodes one sample at a time, as the server does, at the server's
thread count, so the VAE runs the same kernels on the same shapes and the 8-bit frames and 16-bit PCM
are equal (Wan's video, whose server decode runs a latent frame at a time, within one byte)."""

import io
import wave

import numpy as np
import pytest
import torch
from support.adapters import video_and_audio
from support.errors import refused_rollout
from support.families import family_request
from support.servers import at_server_threads

from rollout.v1 import rollout_pb2
from rollout_client import Collector, Preview, Step, collect
from rollout_client.events import Audio, Image, Started
from rollout_core.solvers import data_prediction
from rollout_core.transformer_call import TransformerCall

VELOCITY = rollout_pb2.DEBUG_TENSOR_VELOCITY
ONE_BYTE = 1


def rgb(png: bytes) -> np.ndarray:
    from PIL import Image as PILImage

    return np.asarray(PILImage.open(io.BytesIO(png)).convert("RGB"))


def pil_rgb(images) -> list[np.ndarray]:
    return [np.asarray(image.convert("RGB")) for image in images]


def x0_hats(events: list) -> dict[int, dict[int, torch.Tensor]]:
    """step -> node -> x0_hat [1, ...] from the streamed x_i (x_0 or the step before's x_next, of the
    row's node or its parent), sigma_i and velocity."""
    collector = Collector()
    hats: dict[int, dict[int, torch.Tensor]] = {}
    for event in events:
        if isinstance(event, Step):
            sigmas = torch.tensor(list(collector.started.message.sigmas), dtype=torch.float32)
            rows = event.nodes or range(event.debug["velocity"].shape[0])
            for row, node in enumerate(rows):
                x = (
                    collector.latent(node, event.index)
                    if collector.tree
                    else collector.latents[row, event.index]
                )
                v = event.debug["velocity"][row]
                hats.setdefault(event.index, {})[node] = data_prediction(x, v, sigmas, event.index)[None]
        collector.add(event)
    return hats


def check_order(events: list, preview_steps: list[int]) -> None:
    """Step i's previews come right after its step event, the last of them marked; none elsewhere."""
    current = None
    for previous, event in zip(events, events[1:], strict=False):
        if isinstance(event, Step):
            current = event.index
            assert not isinstance(previous, Preview) or previous.last
        if isinstance(event, Preview):
            assert event.step == current and current in preview_steps
            assert isinstance(previous, Step | Preview) and not (
                isinstance(previous, Preview) and previous.last
            )
    previews = [event for event in events if isinstance(event, Preview)]
    assert sorted({event.step for event in previews}) == sorted(preview_steps)
    assert sum(event.last for event in previews) == len(preview_steps)


def preview_frames(events: list, step: int, node: int) -> list[bytes]:
    return [
        event.media.png
        for event in events
        if isinstance(event, Preview)
        and isinstance(event.media, Image)
        and (event.step, event.sample_index) == (step, node)
    ]


@pytest.mark.parametrize("family", ["flux"])
def test_image_previews_are_the_pipelines_decode_of_x0_hat(family_client, family_pipeline):
    steps = [3, 1]  # in any order
    request = family_request(
        "flux", "FLOW_SDE", cfg=False, images=True, debug_tensors=[VELOCITY], preview_steps=steps
    )
    events = list(family_client.stream(request))
    check_order(events, steps)
    pipe, vae = family_pipeline, family_pipeline.vae
    hats = x0_hats(events)
    for step in steps:
        for k, x0_hat in hats[step].items():
            with torch.no_grad(), at_server_threads():  # FluxPipeline.__call__'s decode after its loop
                latents = pipe._unpack_latents(x0_hat, 64, 64, pipe.vae_scale_factor)
                latents = latents / vae.config.scaling_factor + vae.config.shift_factor
                expected = pipe.image_processor.postprocess(vae.decode(latents, return_dict=False)[0])
            (png,) = preview_frames(events, step, k)
            np.testing.assert_array_equal(rgb(png), *pil_rgb(expected))
    # The collector gives each trajectory its own; the last step's x0_hat is not the final image.
    for k, trajectory in enumerate(collect(events)):
        assert sorted(trajectory.previews) == [1, 3]
        assert trajectory.previews[3] == preview_frames(events, 3, k)
        assert trajectory.preview(1).size == (64, 64)


@pytest.mark.parametrize("family", ["wan"])
def test_video_previews_are_every_frame_of_the_pipelines_decode(family_client, family_pipeline):
    request = family_request(
        "wan",
        "FLOW_SDE",
        cfg=False,
        prompts=["a red fox"],
        samples_per_prompt=1,
        num_frames=9,
        debug_tensors=[VELOCITY],
        preview_steps=[1],
    )
    events = list(family_client.stream(request))
    check_order(events, [1])
    pipe, vae = family_pipeline, family_pipeline.vae
    stats = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(stats)
    std = torch.tensor(vae.config.latents_std).view(stats)
    (x0_hat,) = x0_hats(events)[1].values()
    with torch.no_grad(), at_server_threads():  # WanPipeline.__call__'s decode after its loop
        video = vae.decode(x0_hat * std + mean, return_dict=False)[0]
        expected = pipe.video_processor.postprocess_video(video, output_type="pil")[0]
    frames = preview_frames(events, 1, 0)
    assert len(frames) == 9
    for png, frame in zip(frames, pil_rgb(expected), strict=True):
        # Not bitwise: the server decodes a latent frame at a time (``wan_vae_frames``), the VAE's
        # decode the whole video, whose convolutions round in float32 on other shapes: far below half
        # an 8-bit step, so a value rounds to the same byte or, on a rounding boundary, the next one.
        np.testing.assert_allclose(rgb(png), frame, atol=ONE_BYTE, rtol=0)
    assert not any(isinstance(event, Image) for event in events)  # images=False: previews only


@pytest.mark.parametrize("family", ["ltx2"])
def test_sound_previews_are_the_pipelines_vocoder_on_x0_hat(family_client, family_pipeline):
    request = family_request(
        "ltx2",
        "FLOW_SDE",
        cfg=False,
        prompts=["a red fox"],
        samples_per_prompt=1,
        debug_tensors=[VELOCITY],
        preview_steps=[2],
    )
    events = list(family_client.stream(request))
    check_order(events, [2])
    pipe = family_pipeline
    (x0_hat,) = x0_hats(events)[2].values()
    started = next(event for event in events if isinstance(event, Started))
    streams = TransformerCall.from_proto(started.message.transformer_call).form.streams
    video, audio = video_and_audio(pipe, x0_hat, streams)
    with torch.no_grad(), at_server_threads():
        pixels = torch.clamp(pipe.vae.decode(video, None, return_dict=False)[0], -1, 1)
        expected_frames = pipe.video_processor.postprocess_video(pixels, output_type="pil")[0]
        waveform = pipe.vocoder(pipe.audio_vae.decode(audio, return_dict=False)[0])[0]
    for png, frame in zip(preview_frames(events, 2, 0), pil_rgb(expected_frames), strict=True):
        np.testing.assert_array_equal(rgb(png), frame)
    (sound,) = [event for event in events if isinstance(event, Preview) and isinstance(event.media, Audio)]
    assert sound.last and sound.step == 2
    with wave.open(io.BytesIO(sound.media.wav)) as reader:
        samples = reader.getnframes()
        pcm = np.frombuffer(reader.readframes(samples), dtype="<i2").reshape(samples, -1)
    expected_pcm = (waveform.float().clamp(-1, 1) * 32767).round().to(torch.int16).t().numpy()
    np.testing.assert_array_equal(pcm, expected_pcm)


@pytest.mark.parametrize("family", ["flux"])
def test_each_tree_node_previews_its_own_x0_hat(family_client, family_pipeline):
    request = family_request(
        "flux",
        "FLOW_SDE",
        cfg=False,
        prompts=["a red fox"],
        samples_per_prompt=1,
        branches=[rollout_pb2.Branch(step=0, factor=2), rollout_pb2.Branch(step=2, factor=2)],
        debug_tensors=[VELOCITY],
        preview_steps=[1, 2, 3],
    )
    events = list(family_client.stream(request))
    check_order(events, [1, 2, 3])
    pipe, vae = family_pipeline, family_pipeline.vae
    hats = x0_hats(events)
    # Step 1: the two children of the root; steps 2 and 3: the four leaves (at step 2 the siblings
    # share their parent's x_2 and v_2).
    assert {step: sorted(by_node) for step, by_node in hats.items()} == {
        0: [1, 2],
        1: [1, 2],
        2: [3, 4, 5, 6],
        3: [3, 4, 5, 6],
    }
    decoded = {}
    for step in (1, 2, 3):
        for node, x0_hat in hats[step].items():
            with torch.no_grad(), at_server_threads():
                latents = pipe._unpack_latents(x0_hat, 64, 64, pipe.vae_scale_factor)
                latents = latents / vae.config.scaling_factor + vae.config.shift_factor
                expected = pipe.image_processor.postprocess(vae.decode(latents, return_dict=False)[0])
            (png,) = preview_frames(events, step, node)
            np.testing.assert_array_equal(rgb(png), *pil_rgb(expected))
            decoded[step, node] = rgb(png)
    assert not np.array_equal(decoded[1, 1], decoded[1, 2])  # each node its own
    assert not np.array_equal(decoded[3, 3], decoded[3, 4])
    # A leaf's trajectory carries the previews of the nodes on its path.
    for leaf in collect(events):
        assert leaf.previews[1] == preview_frames(events, 1, leaf.node_path[1])
        assert leaf.previews[3] == preview_frames(events, 3, leaf.sample_index)


@pytest.mark.parametrize("family", ["flux"])
@pytest.mark.parametrize(
    ("steps", "field", "words"),
    [
        ([0, 4], "preview_steps[1]", "must be < num_steps (4)"),
        ([2, 1, 2], "preview_steps[2]", "listed twice"),
        ([0, 1, 2, 3, 0], "preview_steps", "5 preview steps exceed the 4 steps"),
    ],
)
def test_preview_steps_out_of_range_repeated_or_too_many_are_refused(family_client, steps, field, words):
    request = family_request("flux", "FLOW_SDE", cfg=False, preview_steps=steps)
    violations = refused_rollout(family_client, request)
    assert [(v.field, words in v.description) for v in violations] == [(field, True)], violations
