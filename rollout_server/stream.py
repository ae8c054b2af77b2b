"""A rollout's events -> RolloutResponse messages: safetensors payloads, manifests, size-bounded chunks.

``started_event`` assembles what a trainer needs to replay the rollout (resolved request, schedule,
layout, transformer-call rule, env); ``StreamEncoder`` turns the started event, each step, the
previews, the images and the finished event into messages. It decides which tensors each event
carries (latent selection, debug tensors, manifest-only mode) and cuts every payload so that no
message exceeds the server's message limit.
"""

import hashlib
import io
import wave
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout.v1 import rollout_pb2
from rollout_core import codec, dtypes, noise, solvers, wire
from rollout_server.families.base import Sound

if TYPE_CHECKING:
    from rollout_server.families.base import FamilyAdapter
    from rollout_server.parallel import SequenceParallel
    from rollout_server.runner import Rollout
    from rollout_server.sampler import StepRecord

# Room for a message's fields other than its payload bytes, and for protobuf framing.
_FRAMING_BYTES = 1024


def latents_sent(selection: int, stochastic: list[bool]) -> list[bool]:
    """For each latent x_0 .. x_T, whether the selection streams it."""
    num_steps = len(stochastic)
    if selection == rollout_pb2.LATENT_SELECTION_ALL:
        return [True] * (num_steps + 1)
    if selection == rollout_pb2.LATENT_SELECTION_FINAL_ONLY:
        return [j == num_steps for j in range(num_steps + 1)]
    if selection == rollout_pb2.LATENT_SELECTION_AROUND_STOCHASTIC:
        # x_j is an input (j < T) or an output (j > 0) of a stochastic step.
        return [
            (j < num_steps and stochastic[j]) or (j > 0 and stochastic[j - 1]) for j in range(num_steps + 1)
        ]
    return [False] * (num_steps + 1)


def started_event(
    rollout: "Rollout",
    adapter: "FamilyAdapter",
    model_name: str,
    policy_version: int,
    parallel: "SequenceParallel",
) -> tuple[rollout_pb2.RolloutStarted, dict[str, torch.Tensor]]:
    """The started event of ``rollout`` (without tensors), and the env tensors it carries."""
    request, plan = rollout.request, rollout.plan
    # The trainer's x_0 is its own: its hash is echoed, and the x_0 used is streamed where selected.
    resolved = rollout_pb2.RolloutRequest()
    resolved.CopyFrom(request)
    resolved.ClearField("initial_latents")
    env_tensors, env_json = wire.encode_env(
        {branch: dict(enumerate(per_prompt)) for branch, per_prompt in rollout.conditioning.envs.items()}
    )
    started = rollout_pb2.RolloutStarted(
        resolved=resolved,
        seeds=request.seeds,
        prompt_indices=rollout.prompt_indices,
        sigmas=plan.sigmas.tolist(),
        timesteps=rollout.timesteps.tolist(),
        step_transformers=rollout.experts,
        stochastic=plan.stochastic,
        step_solvers=[
            rollout_pb2.SOLVER_UNSPECIFIED if stochastic else solvers.SOLVERS[plan.solver].enum
            for stochastic in plan.stochastic
        ],
        step_orders=plan.step_orders,
        initial_latents_sha256=hashlib.sha256(request.initial_latents).hexdigest()
        if request.initial_latents
        else "",
        log_prob_constants=request.log_prob_constants,
        layout=rollout_pb2.LatentLayout(
            shape=plan.latent_shape,
            packing=adapter.latent_packing(),
            height=request.height,
            width=request.width,
            frames=request.num_frames,
        ),
        transformer_call=rollout_pb2.TransformerCall(
            transformer_class=type(adapter.transformer).__name__,
            model_dtype=dtypes.NAMES[adapter.dtype],
            timestep_divisor=adapter.timestep_divisor,
            timestep_rule=adapter.timestep_rule,
            guidance_rule=rollout.guidance_rule,
            guidance_rule_scale=getattr(request, adapter.cfg_scale_field),
            # Experts with scales of their own: each step's.
            guidance_rule_scales=rollout.cfg_scales if adapter.boundary_ratio is not None else [],
            branches=list(rollout.conditioning.envs),
            batched_env_keys=rollout.conditioning.batched_keys,
            conditioning=adapter.conditioning.to_proto(),
            **rollout.call_form.proto_fields(),
        ),
        model=model_name,
        family=adapter.family,
        policy_version=policy_version,
        sp_degree=parallel.degree,
        attention_split=parallel.attention_split,
        env_json=env_json,
        noise_rule=noise.NOISE_RULE + (noise.STREAMS_RULE if plan.latent_streams else ""),
        tree=rollout.tree.to_proto() if request.branches else [],
        noise_levels=plan.noise_levels,
        condition_images=rollout.condition_images,
    )
    return started, env_tensors


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def wav_bytes(sound: "Sound") -> bytes:
    """A WAV file of 16-bit PCM: the waveform clipped to [-1, 1], scaled by 32767 and rounded."""
    channels = sound.waveform.shape[0]
    pcm = (sound.waveform.float().clamp(-1, 1) * 32767).round().to(torch.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(sound.sample_rate)
        writer.writeframes(pcm.t().contiguous().numpy().astype("<i2").tobytes())  # interleaved
    return buffer.getvalue()


def _image_event(sample_index: int, frame_index: int, image) -> rollout_pb2.RolloutImage:
    return rollout_pb2.RolloutImage(
        sample_index=sample_index, frame_index=frame_index, width=image.width, height=image.height
    )


def _audio_event(sample_index: int, sound: "Sound") -> rollout_pb2.RolloutAudio:
    return rollout_pb2.RolloutAudio(
        sample_index=sample_index, sample_rate=sound.sample_rate, channels=sound.waveform.shape[0]
    )


@dataclass
class StreamEncoder:
    """Encodes a rollout's events and hands each message to ``emit`` (the rollout's outbox)."""

    request: rollout_pb2.RolloutRequest  # resolved
    started: rollout_pb2.RolloutStarted  # everything but tensors
    env_tensors: dict[str, torch.Tensor]
    sent: list[bool]
    emit: Callable[[rollout_pb2.RolloutResponse], None]
    max_message_bytes: int
    tensor_bytes: int = 0

    @property
    def _latent_dtype(self) -> torch.dtype:
        return dtypes.LATENT[self.request.latent_dtype]

    def _send(self, response: rollout_pb2.RolloutResponse, payload_owner, field: str, data: bytes) -> None:
        """Send ``response`` with ``data`` in ``payload_owner.<field>``, cut into size-bounded messages."""
        response.request_id = self.request.request_id
        room = self.max_message_bytes - response.ByteSize() - _FRAMING_BYTES
        chunk_size = self.max_message_bytes - len(self.request.request_id) - _FRAMING_BYTES
        first, rest = codec.split(data, room, chunk_size)
        setattr(payload_owner, field, first)
        payload_owner.following_chunks = len(rest)
        self.emit(response)
        for index, piece in enumerate(rest, start=1):
            chunk = rollout_pb2.PayloadChunk(index=index, data=piece)
            self.emit(rollout_pb2.RolloutResponse(request_id=self.request.request_id, chunk=chunk))

    def _send_tensors(self, response, tensors_message: rollout_pb2.Tensors, tensors: dict) -> None:
        manifest, buffer = codec.encode(tensors)
        tensors_message.manifest.extend(manifest)
        tensors_message.total_bytes = len(buffer) if tensors else 0
        self.tensor_bytes += len(buffer) if tensors else 0
        self._send(
            response, tensors_message, "data", b"" if self.request.manifest_only or not tensors else buffer
        )

    def on_start(self, x0: torch.Tensor) -> None:
        """The started event, with the env tensors and x_0 (when the latent selection sends it)."""
        tensors = dict(self.env_tensors)
        if self.sent[0]:
            tensors[wire.X_0] = x0.to(self._latent_dtype)
        response = rollout_pb2.RolloutResponse()
        response.started.CopyFrom(self.started)
        self._send_tensors(response, response.started.tensors, tensors)

    def on_step(self, record: "StepRecord", nodes: list[int]) -> None:
        """Step ``record.index`` of the rows, which are the tree's ``nodes`` (listed for a tree)."""
        batch = record.x_next.shape[0]
        step = rollout_pb2.RolloutStep(
            index=record.index,
            sigma=self.started.sigmas[record.index],
            sigma_next=self.started.sigmas[record.index + 1],
            timestep=self.started.timesteps[record.index],
            stochastic=record.stochastic,
            noise_std=record.sd.item(),
            nodes=nodes if self.request.branches else [],
        )
        if record.log_probs is not None:
            step.log_probs.extend(record.log_probs.tolist())
            step.stream_log_probs.extend(
                rollout_pb2.StreamLogProbs(stream=name, log_probs=values.tolist())
                for name, values in record.stream_log_probs.items()
            )
        tensors = {}
        if self.sent[record.index + 1]:
            tensors[wire.X_NEXT] = record.x_next.to(self._latent_dtype)
        debug = {wire.DEBUG_TENSORS[d] for d in self.request.debug_tensors}
        if wire.EPS in debug and record.eps is not None:
            tensors[wire.EPS] = record.eps
        if wire.MEAN in debug:
            tensors[wire.MEAN] = record.mean
        if wire.SD in debug:
            tensors[wire.SD] = record.sd.expand(batch).float()
        if wire.VELOCITY in debug:
            tensors[wire.VELOCITY] = record.velocity
        response = rollout_pb2.RolloutResponse(step=step)
        self._send_tensors(response, response.step.tensors, tensors)

    def on_pruned(self, nodes: list[int], step: int) -> None:
        pruned = rollout_pb2.RolloutPruned(nodes=nodes, step=step)
        self.emit(rollout_pb2.RolloutResponse(request_id=self.request.request_id, pruned=pruned))

    def on_image(self, sample_index: int, frame_index: int, image) -> None:
        response = rollout_pb2.RolloutResponse(image=_image_event(sample_index, frame_index, image))
        self._send(response, response.image, "png", png_bytes(image))

    def on_audio(self, sample_index: int, sound: "Sound") -> None:
        response = rollout_pb2.RolloutResponse(audio=_audio_event(sample_index, sound))
        self._send(response, response.audio, "wav", wav_bytes(sound))

    def on_preview(self, step: int, sample_index: int, frame_index: int, media, last: bool) -> None:
        """A preview of step ``step``: frame ``frame_index`` of row ``sample_index``'s decoded x0_hat
        (an image), or its sound (a Sound); ``last``: the step's last preview."""
        preview = rollout_pb2.RolloutPreview(step=step, last=last)
        if isinstance(media, Sound):
            preview.audio.CopyFrom(_audio_event(sample_index, media))
            response = rollout_pb2.RolloutResponse(preview=preview)
            self._send(response, response.preview.audio, "wav", wav_bytes(media))
        else:
            preview.image.CopyFrom(_image_event(sample_index, frame_index, media))
            response = rollout_pb2.RolloutResponse(preview=preview)
            self._send(response, response.preview.image, "png", png_bytes(media))

    def on_finish(self, finished: rollout_pb2.RolloutFinished) -> None:
        finished.tensor_bytes = self.tensor_bytes
        self.emit(rollout_pb2.RolloutResponse(request_id=self.request.request_id, finished=finished))
