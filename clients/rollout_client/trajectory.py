"""One sample's trajectory, gathered from a rollout stream, with save/load as one safetensors file.

A tree rollout's trajectories are its leaves: each is the path from its root, and siblings share the
latents of their common prefix in memory (``PathLatents``), as they do on the wire.
"""

import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from google.protobuf import json_format
from PIL import Image as PILImage
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rollout_client.events import Audio, Event, Finished, Image, Preview, Pruned, Started, Step
from rollout_core import latent_streams, wire
from rollout_core.solvers import FALLBACK_SOLVER, SOLVERS, SOLVERS_BY_ENUM
from rollout_core.steps import SAMPLERS_BY_ENUM
from rollout_core.transformer_call import TransformerCall
from rollout_core.tree import Tree

# Saved-trajectory metadata: the env's non-tensor values, in the started event's env_json layout;
# files written before the env's names held the prompt index have them per branch only.
_ENV_JSON = "env_json"
_LEGACY_ENV_VALUES = "env_values"


class PathLatents:
    """A tree leaf's x_0 .. x_T without a copy: ``[j]`` is a view of the buffer of the path's node
    that owns x_j, so a leaf's prefix is its siblings' memory. Indexes like the [T + 1, ...] tensor
    of a flat trajectory; ``stack()`` makes that tensor."""

    def __init__(self, rows: list[torch.Tensor], shape: tuple[int, ...]):
        self.rows = rows
        self.shape = torch.Size((len(rows), *shape))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, j: int) -> torch.Tensor:
        return self.rows[j]

    def stack(self) -> torch.Tensor:
        return torch.stack(self.rows) if self.rows else torch.zeros(self.shape)


@dataclass
class Trajectory:
    """Everything a trainer needs to replay one sample.

    ``latents[j]`` is x_j (float32 [T + 1, ...]); latents the stream did not carry are NaN and
    ``latent_mask[j]`` is False (with no latents streamed at all, ``latents`` has no rows).
    ``log_probs[i]`` is NaN where step i is not stochastic. A tree leaf's ``sample_index`` is its
    node id, ``node_path`` the ids from its root down, and ``latents`` a ``PathLatents``.
    """

    request_id: str
    sample_index: int
    prompt_index: int
    prompt: str
    seed: int
    sampler_type: str
    noise_level: float
    log_prob_constants: bool
    sigmas: torch.Tensor  # float32 [T + 1]
    timesteps: torch.Tensor  # float32 [T + 1]
    stochastic: torch.Tensor  # bool [T]
    latents: torch.Tensor  # [T + 1, ...] in the streamed latent dtype's values, as float32
    latent_mask: torch.Tensor  # bool [T + 1]
    log_probs: torch.Tensor  # float32 [T]
    env: dict[str, dict[str, Any]]  # branch -> kwargs (batched entries with leading dim 1)
    # How the server called the transformer and guided: its fields and their rule are documented on
    # rollout_core.transformer_call.TransformerCall.
    transformer_call: TransformerCall
    policy_version: int
    # [T]: the pipeline component whose transformer ran each step ("transformer", or "transformer_2"
    # on Wan 2.2's low-noise steps); replay step i with that expert.
    step_transformers: list[str] = field(default_factory=list)
    image_png: bytes | None = None  # the image, or a video's first frame
    frames_png: list[bytes] = field(default_factory=list)  # every frame (an image: the one)
    noise_levels: list[float] = field(default_factory=list)  # [T]; empty: noise_level at every step
    node_path: list[int] = field(default_factory=list)  # a tree leaf's nodes, root first
    tree: Tree | None = None  # a tree leaf's tree (one object for all its leaves; not saved)
    # Image-conditioned families: the prompt's conditioning image file as the client sent it, and how
    # the server read it (ConditionImageInfo's JSON mapping). Its latents are in ``env``.
    condition_png: bytes | None = None
    condition_image: dict[str, Any] = field(default_factory=dict)
    # The deterministic steps' solver (rollout_core.solvers; servers before solvers ran Euler) and
    # each step's order (empty from such a server).
    solver: str = FALLBACK_SOLVER
    step_orders: list[int] = field(default_factory=list)
    # Several latent streams (LTX-2): each stream's own log-probs, float32 [T] (NaN where not
    # stochastic); ``log_probs`` is their joint. And the sample's sound, a WAV file, where it has one.
    stream_log_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    audio_wav: bytes | None = None
    # The request's preview_steps: step i -> the decoded x0_hat = x_i - sigma_i v_i of the sample (a
    # tree leaf: of the node on its path that took step i), its frames' PNGs in order, and its sound's
    # WAV where it has one. Not saved.
    previews: dict[int, list[bytes]] = field(default_factory=dict)
    preview_audio: dict[int, bytes] = field(default_factory=dict)
    # step i -> the reward of ``previews[i]``, for the steps ``preview_rewards.score_previews`` scored
    # before ``Collector.trajectories()`` built this trajectory. Not saved.
    step_rewards: dict[int, float] = field(default_factory=dict)

    @property
    def streams(self) -> tuple[latent_streams.LatentStream, ...]:
        """The latent streams of the sample, in order; empty for a family with one latent tensor."""
        return self.transformer_call.form.streams

    def stream_latents(self, name: str) -> torch.Tensor:
        """The latents of stream ``name``, [T + 1, *its shape]: a view of the joint ``latents``."""
        latents = self.latents.stack() if isinstance(self.latents, PathLatents) else self.latents
        streams = self.streams
        index = [stream.name for stream in streams].index(name)
        return latent_streams.split(latents, streams)[index]

    def noise_level_at(self, i: int) -> float:
        """The noise level step i used (a tree's branch step may have its own)."""
        return self.noise_levels[i] if self.noise_levels else self.noise_level

    @property
    def num_steps(self) -> int:
        return len(self.stochastic)

    def image(self) -> PILImage.Image | None:
        return PILImage.open(io.BytesIO(self.image_png)) if self.image_png else None

    def frames(self) -> list[PILImage.Image]:
        """The sample's decoded frames in order (one for an image)."""
        return [PILImage.open(io.BytesIO(png)) for png in self.frames_png]

    def preview(self, step: int) -> PILImage.Image:
        """The first frame of the preview at ``step`` (an image model's image)."""
        return PILImage.open(io.BytesIO(self.previews[step][0]))

    def conditioning(self) -> PILImage.Image | None:
        """The conditioning image, as sent."""
        return PILImage.open(io.BytesIO(self.condition_png)) if self.condition_png else None

    def save(self, path: str | Path) -> None:
        """Write tensors, env, frames and metadata to one safetensors file (names: ``rollout_core.wire``)."""
        env_tensors, env_json = wire.encode_env(
            {branch: {self.prompt_index: env} for branch, env in self.env.items()}
        )
        tensors = {
            wire.SIGMAS: self.sigmas,
            wire.TIMESTEPS: self.timesteps,
            wire.STOCHASTIC: self.stochastic.to(torch.uint8),
            wire.LATENTS: self.latents.stack() if isinstance(self.latents, PathLatents) else self.latents,
            wire.LATENT_MASK: self.latent_mask.to(torch.uint8),
            wire.LOG_PROBS: self.log_probs,
            # Copies: safetensors stores no tensor that shares memory with another.
            **{name: tensor.contiguous().clone() for name, tensor in env_tensors.items()},
        }
        for j, png in enumerate(self.frames_png):
            tensors[wire.frame_name(j)] = torch.frombuffer(bytearray(png), dtype=torch.uint8)
        if self.condition_png:
            tensors[wire.CONDITION_IMAGE] = torch.frombuffer(bytearray(self.condition_png), dtype=torch.uint8)
        if self.audio_wav:
            tensors[wire.AUDIO_WAV] = torch.frombuffer(bytearray(self.audio_wav), dtype=torch.uint8)
        for name, values in self.stream_log_probs.items():
            tensors[wire.stream_log_probs_name(name)] = values
        scalars = {
            k: getattr(self, k)
            for k in (
                "request_id",
                "sample_index",
                "prompt_index",
                "prompt",
                "seed",
                "sampler_type",
                "noise_level",
                "log_prob_constants",
                "policy_version",
                "step_transformers",
                "noise_levels",
                "node_path",
                "condition_image",
                "solver",
                "step_orders",
            )
        }
        metadata = {
            "trajectory": json.dumps(scalars),
            _ENV_JSON: env_json,
            "transformer_call": self.transformer_call.to_json(),
        }
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> "Trajectory":
        """A trajectory saved by ``save``, by this version or an earlier one."""
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(path))
        # The file holds one prompt's env: the trajectory's.
        envs = wire.decode_env(tensors, metadata.get(_ENV_JSON, ""))
        env = {branch: per_prompt.popitem()[1] for branch, per_prompt in envs.items()}
        for branch, values in json.loads(metadata.get(_LEGACY_ENV_VALUES, "{}")).items():
            env.setdefault(branch, {}).update(values)
        frames = [tensors[wire.frame_name(j)] for j in range(wire.frame_count(tensors))]
        if not frames and wire.LEGACY_IMAGE_PNG in tensors:
            frames = [tensors[wire.LEGACY_IMAGE_PNG]]
        return cls(
            **json.loads(metadata["trajectory"]),
            sigmas=tensors[wire.SIGMAS],
            timesteps=tensors[wire.TIMESTEPS],
            stochastic=tensors[wire.STOCHASTIC].bool(),
            latents=tensors[wire.LATENTS],
            latent_mask=tensors[wire.LATENT_MASK].bool(),
            log_probs=tensors[wire.LOG_PROBS],
            env=env,
            transformer_call=TransformerCall.from_json(metadata["transformer_call"]),
            **_frames([frame.numpy().tobytes() for frame in frames]),
            condition_png=tensors[wire.CONDITION_IMAGE].numpy().tobytes()
            if wire.CONDITION_IMAGE in tensors
            else None,
            stream_log_probs=wire.stream_log_probs_of(tensors),
            audio_wav=tensors[wire.AUDIO_WAV].numpy().tobytes() if wire.AUDIO_WAV in tensors else None,
        )


class Collector:
    """Gathers a rollout stream event by event, so a trainer can work on steps as they arrive.

    ``add`` each event; ``trajectories()`` may be called at any time after the started event: the
    trajectories it returns share the collector's buffers, so latents and log-probs that arrive later
    appear in them (until then latents are NaN with ``latent_mask`` False, log-probs NaN).
    ``ready(i)`` says whether step i can be scored now (x_i, x_{i+1} and its log-probs have arrived).
    A tree rollout gives one trajectory per leaf that was not pruned; ``tree`` is its tree.
    ``condition_images``: the request's conditioning image files, one per prompt, which the
    trajectories carry (the stream does not send them back). ``previews[i][node]`` holds the frames'
    PNGs of the preview of step i of each sample or tree node (by frame index), ``preview_audio[i][node]``
    its WAV, as they arrive; ``previewed`` the steps whose previews have all arrived (the last said so).
    ``step_rewards[i][node]`` holds the reward of each preview of step i, once
    ``rollout_client.preview_rewards.score_previews`` has scored it.
    """

    def __init__(self, condition_images: Sequence[bytes] = ()):
        self.condition_images = list(condition_images)
        self.started: Started | None = None
        self.finished: Finished | None = None
        self.tree: Tree | None = None
        self.pruned: set[int] = set()
        self.node_latents: dict[int, torch.Tensor] = {}  # a tree's: node -> its own latents
        self.latents: torch.Tensor | None = None  # [B, T + 1, ...] once a latent arrives
        self.mask = torch.zeros(0, dtype=torch.bool)
        self.log_probs = torch.zeros(0)
        self.scored = torch.zeros(0, dtype=torch.bool)
        self.images: dict[int, dict[int, bytes]] = {}  # sample -> frame -> PNG
        self.audio: dict[int, bytes] = {}  # sample -> WAV
        self.stream_log_probs: dict[str, torch.Tensor] = {}  # stream -> [B, T]
        self.previews: dict[int, dict[int, dict[int, bytes]]] = {}  # step -> node -> frame -> PNG
        self.preview_audio: dict[int, dict[int, bytes]] = {}  # step -> node -> WAV
        self.previewed: set[int] = set()
        self.step_rewards: dict[int, dict[int, float]] = {}  # step -> node -> reward of its preview

    def add(self, event: Event) -> None:
        if isinstance(event, Started):
            self.started = event
            num_samples, num_steps = len(event.message.seeds), len(event.message.stochastic)
            if event.message.tree:
                self.tree = Tree.from_proto(event.message.tree, num_steps)
                self._leaf_rows = {leaf.id: row for row, leaf in enumerate(self.tree.leaves)}
                # Each node's log-prob is every leaf's below it: their rows, found once.
                self._rows_under = {
                    node.id: [self._leaf_rows[leaf.id] for leaf in self.tree.leaves_under(node.id)]
                    for node in self.tree.nodes
                }
                num_samples = len(self._leaf_rows)
            self.mask = torch.zeros(num_steps + 1, dtype=torch.bool)
            self.log_probs = torch.full((num_samples, num_steps), float("nan"))
            self.scored = torch.zeros(num_steps, dtype=torch.bool)
            if event.x0 is not None:
                self._store(0, event.x0, [root.id for root in self.tree.roots] if self.tree else [])
        elif isinstance(event, Step):
            if event.x_next is not None:
                self._store(event.index + 1, event.x_next, event.nodes)
            if event.log_probs is not None:
                self._store_log_probs(self.log_probs, event.index, event.log_probs, event.nodes)
                for name, values in event.stream_log_probs.items():
                    if name not in self.stream_log_probs:
                        self.stream_log_probs[name] = torch.full_like(self.log_probs, float("nan"))
                    self._store_log_probs(self.stream_log_probs[name], event.index, values, event.nodes)
                self.scored[event.index] = True
        elif isinstance(event, Pruned):
            self.pruned.update(event.nodes)
        elif isinstance(event, Image):
            self.images.setdefault(event.sample_index, {})[event.frame_index] = event.png
        elif isinstance(event, Audio):
            self.audio[event.sample_index] = event.wav
        elif isinstance(event, Preview):
            media = event.media
            if isinstance(media, Audio):
                self.preview_audio.setdefault(event.step, {})[media.sample_index] = media.wav
            else:
                by_node = self.previews.setdefault(event.step, {})
                by_node.setdefault(media.sample_index, {})[media.frame_index] = media.png
            if event.last:
                self.previewed.add(event.step)
        elif isinstance(event, Finished):
            self.finished = event

    def _store_log_probs(self, table: torch.Tensor, i: int, values: torch.Tensor, nodes: list[int]) -> None:
        """Step i's log-probs into ``table`` [rows, T]: by row, or a tree's by each node's leaves."""
        if self.tree is None:
            table[:, i] = values
            return
        for node, log_prob in zip(nodes, values.tolist(), strict=True):
            table[self._rows_under[node], i] = log_prob

    def _store(self, j: int, x: torch.Tensor, nodes: list[int]) -> None:
        self.mask[j] = True
        if self.tree is not None:
            for node, row in zip(nodes, x, strict=True):
                self._node_buffer(node)[j - self.tree[node].first_latent] = row.float()
            return
        if self.latents is None:
            message = self.started.message
            shape = (len(message.seeds), len(message.stochastic) + 1, *message.layout.shape)
            self.latents = torch.full(shape, float("nan"))
        self.latents[:, j] = x.float()

    def _node_buffer(self, node_id: int) -> torch.Tensor:
        """The latents ``node_id`` owns (see ``rollout_core.tree``), NaN until they arrive."""
        if node_id not in self.node_latents:
            node = self.tree[node_id]
            owned = node.end_step - node.first_latent + 1
            self.node_latents[node_id] = torch.full((owned, *self.started.message.layout.shape), float("nan"))
        return self.node_latents[node_id]

    def latent(self, node_id: int, j: int) -> torch.Tensor:
        """A tree rollout's x_j on the path of ``node_id`` (its own, or an ancestor's), as streamed
        (NaN until it arrives)."""
        owner = self.tree.owner(node_id, j)
        return self._node_buffer(owner.id)[j - owner.first_latent]

    def _leaf_latents(self, leaf_id: int) -> PathLatents:
        shape = tuple(self.started.message.layout.shape)
        if not self.mask.any():
            return PathLatents([], shape)
        rows = []
        for node in self.tree.path(leaf_id):
            buffer = self._node_buffer(node.id)
            rows.extend(buffer[j - node.first_latent] for j in range(node.first_latent, node.end_step + 1))
        return PathLatents(rows, shape)

    def ready(self, i: int) -> bool:
        """Step i is stochastic and x_i, x_{i+1} and its log-probs have arrived."""
        return bool(self.scored[i] and self.mask[i] and self.mask[i + 1])

    def trajectories(self) -> list[Trajectory]:
        """One Trajectory per sample (prompt-major order), with what has arrived so far."""
        if self.started is None:
            raise ValueError("no started event yet")
        message = self.started.message
        if self.tree is not None:
            leaves = [leaf for leaf in self.tree.leaves if leaf.id not in self.pruned]
            latents = [self._leaf_latents(leaf.id) for leaf in leaves]
            rows = [self._leaf_rows[leaf.id] for leaf in leaves]
        else:
            latents = self.latents
            if latents is None:
                latents = torch.zeros(len(message.seeds), 0, *message.layout.shape)
            leaves, rows = (), range(len(message.seeds))
        return _trajectories(self, latents, rows, leaves)


def _frames(frames: list[bytes]) -> dict[str, Any]:
    """``image_png`` and ``frames_png`` of a sample's frames in order."""
    return {"image_png": frames[0] if frames else None, "frames_png": frames}


def collect(events: Iterable[Event], condition_images: Sequence[bytes] = ()) -> list[Trajectory]:
    """Gather a whole rollout stream into one Trajectory per sample (prompt-major order); see
    ``Collector`` for ``condition_images``."""
    collector = Collector(condition_images)
    for event in events:
        collector.add(event)
    if collector.started is None or collector.finished is None:
        raise ValueError("incomplete rollout stream: no started or no finished event")
    return collector.trajectories()


def _trajectories(collector: Collector, latents, rows, leaves) -> list[Trajectory]:
    """Trajectory k: ``latents[k]``, and row ``rows[k]`` of the collector's log-prob tables; the
    collector's samples, or its tree's ``leaves``."""
    started, tree = collector.started, collector.tree
    message = started.message
    condition_infos = [
        json_format.MessageToDict(info, preserving_proto_field_name=True) for info in message.condition_images
    ]
    resolved = message.resolved
    transformer_call = TransformerCall.from_proto(message.transformer_call)
    sigmas = torch.tensor(list(message.sigmas), dtype=torch.float32)
    timesteps = torch.tensor(list(message.timesteps), dtype=torch.float32)
    stochastic = torch.tensor(list(message.stochastic), dtype=torch.bool)
    if tree is None:
        samples = [
            (k, seed, p, [])
            for k, (seed, p) in enumerate(zip(message.seeds, message.prompt_indices, strict=True))
        ]

        def took(k: int, i: int) -> int:
            return k
    else:
        samples = [
            (leaf.id, leaf.seed, leaf.prompt_index, [n.id for n in tree.path(leaf.id)]) for leaf in leaves
        ]

        def took(k: int, i: int) -> int:
            """The node on leaf k's path that took step i."""
            return next(n.id for n in tree.path(k) if n.start_step <= i < n.end_step)

    trajectories = []
    for position, (row, (k, seed, p, node_path)) in enumerate(zip(rows, samples, strict=True)):
        trajectories.append(
            Trajectory(
                request_id=started.request_id,
                sample_index=k,
                prompt_index=p,
                prompt=resolved.prompts[p],
                seed=seed,
                sampler_type=SAMPLERS_BY_ENUM[resolved.sampler].name,
                noise_level=resolved.noise_level,
                log_prob_constants=message.log_prob_constants,
                sigmas=sigmas,
                timesteps=timesteps,
                stochastic=stochastic,
                latents=latents[position],
                latent_mask=collector.mask,
                log_probs=collector.log_probs[row],
                env={branch: per_prompt[p] for branch, per_prompt in started.env.items()},
                transformer_call=transformer_call,
                policy_version=message.policy_version,
                step_transformers=list(message.step_transformers),
                **_frames([png for _, png in sorted(collector.images.get(k, {}).items())]),
                noise_levels=list(message.noise_levels),
                node_path=node_path,
                tree=tree,
                condition_png=collector.condition_images[p] if collector.condition_images else None,
                condition_image=condition_infos[p] if condition_infos else {},
                solver=SOLVERS_BY_ENUM.get(resolved.solver, SOLVERS[FALLBACK_SOLVER]).name,
                step_orders=list(message.step_orders),
                stream_log_probs={name: table[row] for name, table in collector.stream_log_probs.items()},
                audio_wav=collector.audio.get(k),
                previews={
                    i: [png for _, png in sorted(by_node[took(k, i)].items())]
                    for i, by_node in collector.previews.items()
                    if took(k, i) in by_node
                },
                preview_audio={
                    i: by_node[took(k, i)]
                    for i, by_node in collector.preview_audio.items()
                    if took(k, i) in by_node
                },
                step_rewards={
                    i: by_node[took(k, i)]
                    for i, by_node in collector.step_rewards.items()
                    if took(k, i) in by_node
                },
            )
        )
    return trajectories
