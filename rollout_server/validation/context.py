"""What validation knows of the server: the served model (through ``ServedModel``, the part of a family
adapter it reads), the request defaults it serves, its limits and its sequence-parallel split."""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rollout.v1 import rollout_pb2
from rollout_core import solvers, steps
from rollout_core.layout import DEFAULT_GROUP_SIZE

if TYPE_CHECKING:
    from rollout_server.families.base import FamilyDefaults, MediaShape
    from rollout_server.limits import Limits


class ServedModel(Protocol):
    """What validation reads of the loaded model, all of it read only: a ``FamilyAdapter`` is one (its
    class attributes and the properties it derives from its pipeline), so nothing is copied and no
    default is stated twice."""

    @property
    def side_multiple(self) -> int: ...  # height and width are multiples of it

    @property
    def min_side(self) -> int: ...  # height and width are at least this many pixels

    @property
    def max_frames(self) -> int: ...  # 1 for an image family

    @property
    def frame_step(self) -> int: ...  # video families: num_frames - 1 is a multiple of it

    @property
    def min_steps(self) -> int: ...  # the fewest steps the model's schedule is defined for

    @property
    def solver(self) -> str: ...  # the family's deterministic solver (its pipeline's)

    @property
    def cfg_scale_field(self) -> str: ...  # the request field holding the CFG scale

    @property
    def cfg_off_scale(self) -> float: ...  # the CFG scale at and below which no negative branch runs

    @property
    def scale_fields(self) -> tuple[str, ...]: ...  # the scales the model reads

    # Models with two experts (Wan 2.2): the pipeline's boundary_ratio; they take guidance_scale_2 and
    # boundary_ratio. None: one expert.
    @property
    def boundary_ratio(self) -> float | None: ...

    # Image-conditioned families: one conditioning image per prompt, encoded as image_encoding says.
    @property
    def takes_images(self) -> bool: ...

    @property
    def image_encoding(self) -> str: ...

    def latent_shape(self, shape: "MediaShape") -> tuple[int, ...]: ...  # one sample's latent

    # Tokens of one sample the attention sees, and those its conditioning image adds on the sequence
    # (the sequence-parallel split cuts both together).
    def generated_tokens(self, shape: "MediaShape") -> int: ...

    def conditioning_tokens(self, shape: "MediaShape") -> int: ...


@dataclass(frozen=True)
class ServingContext:
    """What validation needs to know about the server: the loaded ``model``, the request ``defaults`` it
    serves, its ``limits``, and the sequence-parallel split (one sample's tokens must divide by
    ``seq_len_divisor``)."""

    model: ServedModel
    defaults: "FamilyDefaults"
    limits: "Limits"
    seq_len_divisor: int = 1

    @property
    def has_cfg(self) -> bool:
        """Whether the model runs CFG at all: it reads its ``cfg_scale_field``. A guidance-distilled
        model (FLUX.2 [dev]) or a step-distilled one (a distilled FLUX.2 [klein]) reads none, so
        GetServerInfo states no CFG field for it, and the rule "none"."""
        return self.model.cfg_scale_field in self.model.scale_fields

    @property
    def max_request_bytes(self) -> int:
        """The largest request this server receives (see ``Limits.max_request_bytes``)."""
        return self.limits.max_request_bytes(self.model.takes_images)


def defaults_proto(context: ServingContext) -> rollout_pb2.RolloutRequest:
    """The defaults applied to unset request fields, as GetServerInfo reports them."""
    d = context.defaults
    return rollout_pb2.RolloutRequest(
        samples_per_prompt=DEFAULT_GROUP_SIZE,
        height=d.height,
        width=d.width,
        num_frames=d.frames,
        num_steps=d.num_steps,
        guidance_scale=d.guidance_scale,
        true_cfg_scale=d.true_cfg_scale,
        sampler=steps.DEFAULT_SAMPLER.enum,
        solver=solvers.SOLVERS[context.model.solver].enum,
        noise_level=d.noise_level,
        latents=rollout_pb2.LATENT_SELECTION_ALL,
        latent_dtype=rollout_pb2.TENSOR_DTYPE_FLOAT32,
        images=True,
        boundary_ratio=context.model.boundary_ratio,
    )


def finite_in(value: float, low: float, high: float) -> bool:
    """Whether a client's float is finite and in [low, high]."""
    return math.isfinite(value) and low <= value <= high


# Bad fields: (field, what is wrong) each, as ``InvalidRequest`` reports them.
Problems = list[tuple[str, str]]
