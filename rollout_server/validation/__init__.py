"""Request validation: turn a RolloutRequest into a fully resolved one, or name every bad field.

Every problem is collected (not just the first) and reported as a google.rpc.BadRequest field
violation, so a trainer sees at once everything that is wrong with its request. One module a concern:
``context`` (what validation knows of the server and its model), ``request`` (``resolve``, the prompts
and what the stream carries), ``media`` (size, frames, latent, x_0, conditioning images, the
sequence-parallel split), ``schedule`` (steps, sigmas, sampler, noise, solver), ``guidance`` (CFG and
guidance scales, the negative prompt, a second expert), ``trees`` (branch, prune and preview steps).
"""

from rollout_server.validation.context import ServedModel, ServingContext, defaults_proto
from rollout_server.validation.guidance import SCALE_FIELDS
from rollout_server.validation.media import check_prompt_tokens, initial_latents, read_images
from rollout_server.validation.request import resolve
from rollout_server.validation.schedule import step_noise_levels

__all__ = [
    "SCALE_FIELDS",
    "ServedModel",
    "ServingContext",
    "check_prompt_tokens",
    "defaults_proto",
    "initial_latents",
    "read_images",
    "resolve",
    "step_noise_levels",
]
