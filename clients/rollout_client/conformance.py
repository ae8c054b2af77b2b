"""The conformance kit's requests and checks: one rollout per sampler x CFG mode x solver window, built
from GetServerInfo alone (so any server of any family answers them), and the checks of its stream.

`conformance/generate.py` records these rollouts of the tiny presets as the kit's vectors, which
`conformance/replay.py` checks from the documented formulas alone; `rollout-client conformance` sends
them to a live server and checks each stream with this library:

* noise: x_0 and every stochastic step's eps (the EPS debug tensors) are the seed rule's draws,
  bitwise (`rollout_core.noise`);
* log-probs: every stochastic step's log-prob, recomputed from the streamed x_i and x_{i+1} and the
  velocity (the VELOCITY debug tensors, or the transformer of ``--model`` by the transformer-call
  rule), within ``log_prob_tolerance`` of the streamed one (`rollout_core.steps`);
* latents: every step's x_{i+1}, recomputed from the streamed x_i and the same velocities (a
  deterministic step by its solver, `rollout_core.solvers`; a stochastic one as mean + sd eps), within
  ``latent_tolerance`` of the streamed one: the final latent among them.
"""

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rollout.v1 import rollout_pb2
from rollout_client.events import Started, Step
from rollout_client.grpo import expert, guided_velocity
from rollout_client.replay import regenerate_deterministic_steps
from rollout_client.trajectory import collect
from rollout_core import dtypes, noise, solvers, steps

PROMPT = "a red fox in the snow"
NEGATIVE_PROMPT = "blurry"
BASE_SEED = 7
SAMPLES = 2  # one prompt's group: two seeds, two rows of every forward
NOISE_LEVEL = 0.7  # within every SDE sampler's bound (CPS's is 1)
CFG_SCALE = 4.0
# SDE on every step: 3 steps (the first takes FLOW_SDE's first-step rule, the last CPS's step into
# sigma = 0). A window: SDE on step 2 of 6, the solver on steps 0-1 (first order, then second) and on
# 3-5, started again after the window: first order, then second (UniPC's corrector after either order),
# then the last step.
ALL_STEPS = 3
WINDOW_STEPS = 6
WINDOW = (2,)
SDE_SAMPLERS = ("FLOW_SDE", "DANCE", "CPS")
DEBUG_TENSORS = [
    rollout_pb2.DEBUG_TENSOR_EPS,
    rollout_pb2.DEBUG_TENSOR_MEAN,
    rollout_pb2.DEBUG_TENSOR_SD,
    rollout_pb2.DEBUG_TENSOR_VELOCITY,
]
# Replay parity in float32 (docs/testing.md, "Replay"): the rounding of the streamed x_{i+1} and the
# velocity's difference between two forwards, each over sd and averaged over the latent's elements.
FLOAT32_TOLERANCE = 1e-5
FLOAT32_ROUNDOFF = 2.0**-24


@dataclass(frozen=True)
class Case:
    """One conformance rollout: its sampler, CFG on or off, the solver of its deterministic steps, and
    whether its SDE runs on the steps of ``WINDOW`` alone (an SDE sampler) or on all of them; ODE has
    no stochastic step."""

    sampler: str
    cfg: bool
    solver: str
    window: bool

    @property
    def cfg_name(self) -> str:
        return "cfg" if self.cfg else "no-cfg"

    @property
    def window_name(self) -> str:
        if self.sampler == "ODE":
            return self.solver
        if self.window:
            return f"sde {','.join(map(str, WINDOW))} in {self.solver}"
        return "sde all"

    @property
    def name(self) -> str:
        return f"{self.sampler}/{self.cfg_name}/{self.window_name}"

    @property
    def num_steps(self) -> int:
        return ALL_STEPS if self.sampler != "ODE" and not self.window else WINDOW_STEPS


def runs_cfg(info: rollout_pb2.GetServerInfoResponse) -> bool:
    """Whether the served model has a negative branch to turn on (FLUX.2 [dev] has none)."""
    return bool(info.cfg_scale_field) and info.cfg_rule not in ("", "none")


def cases(info: rollout_pb2.GetServerInfoResponse) -> list[Case]:
    """Every case the server serves: each SDE sampler on all steps (Euler into a CPS step's sigma = 0)
    and in a window within each solver, and ODE with each solver; CFG off, and on where the model has
    it. A server from before the solvers lists none, and runs Euler."""
    served = {rollout_pb2.SamplerType.Name(kind).removeprefix("SAMPLER_TYPE_") for kind in info.sampler_types}
    solver_names = [solvers.SOLVERS_BY_ENUM[s].name for s in info.solvers if s in solvers.SOLVERS_BY_ENUM]
    solver_names = solver_names or [solvers.FALLBACK_SOLVER]
    found = []
    for cfg in (False, True) if runs_cfg(info) else (False,):
        for sampler in (s for s in (*SDE_SAMPLERS, "ODE") if s in served):
            if sampler != "ODE":
                found.append(Case(sampler, cfg, solvers.FALLBACK_SOLVER, window=False))
            found += [Case(sampler, cfg, solver, window=sampler != "ODE") for solver in solver_names]
    return found


def condition_png(side: int) -> bytes:
    """The conditioning image of an image-conditioned model's request: a colour gradient."""
    from PIL import Image

    ramp = torch.linspace(0, 255, side).to(torch.uint8)
    pixels = torch.stack([ramp.expand(side, side), ramp.expand(side, side).T, 255 - ramp.expand(side, side)])
    buffer = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def request(
    info: rollout_pb2.GetServerInfoResponse, case: Case, size: tuple[int, int, int] | None = None
) -> rollout_pb2.RolloutRequest:
    """The case's request: one prompt, ``SAMPLES`` seeds from ``BASE_SEED``, float32 latents, every
    latent and the debug tensors streamed, no images. ``size`` is (height, width, frames); unset, the
    smallest size of ``default_size``."""
    height, width, frames = size or default_size(info)
    fields = {
        "prompts": [PROMPT],
        "samples_per_prompt": SAMPLES,
        "base_seed": BASE_SEED,
        "height": height,
        "width": width,
        "num_steps": case.num_steps,
        "sampler": rollout_pb2.SamplerType.Value(f"SAMPLER_TYPE_{case.sampler}"),
        "solver": solvers.solver_named(case.solver).enum if info.solvers else None,
        "latents": rollout_pb2.LATENT_SELECTION_ALL,
        "latent_dtype": rollout_pb2.TENSOR_DTYPE_FLOAT32,
        "debug_tensors": DEBUG_TENSORS,
        "images": False,
        "num_frames": frames or None,
        "noise_level": NOISE_LEVEL if case.sampler != "ODE" else None,
        "stochastic_steps": list(WINDOW) if case.window else None,
    }
    if case.cfg:
        fields |= {info.cfg_scale_field: CFG_SCALE, "negative_prompt": NEGATIVE_PROMPT}
    elif runs_cfg(info) and getattr(info.defaults, info.cfg_scale_field) > _cfg_off_scale(info):
        fields[info.cfg_scale_field] = _cfg_off_scale(info)
    if "condition_images" in info.features:
        fields["condition_images"] = [rollout_pb2.ConditionImage(data=condition_png(max(height, width)))]
    return rollout_pb2.RolloutRequest(**{name: value for name, value in fields.items() if value is not None})


def default_size(info: rollout_pb2.GetServerInfoResponse) -> tuple[int, int, int]:
    """(height, width, frames) of the cases: 2 x ``limits.side_multiple`` pixels (2 x 2 patches of
    the packed families), at least ``limits.min_side`` (LTX-2's decoder needs 64), and one frame, sent
    to a video family (whose default is more); frames 0 leaves an image family's unset."""
    side = max(2 * info.limits.side_multiple, info.limits.min_side)
    return side, side, 1 if info.limits.frame_step else 0


def _cfg_off_scale(info: rollout_pb2.GetServerInfoResponse) -> float:
    return info.cfg_off_scale if info.HasField("cfg_off_scale") else 1.0


def dtype_factor(model_dtype: str) -> float:
    """How many times float32's unit roundoff the model dtype's is: the velocity's difference between
    two forwards, and with it every tolerance below, grows by it (bf16: 2^16)."""
    return max(1.0, torch.finfo(dtypes.BY_NAME[model_dtype]).eps / 2 / FLOAT32_ROUNDOFF)


def log_prob_tolerance(model_dtype: str) -> float:
    """A replayed log-prob's bound (docs/testing.md, "Replay"), scaled by the model dtype."""
    return FLOAT32_TOLERANCE * dtype_factor(model_dtype)


def latent_tolerance(model_dtype: str, guidance_rule: str, guidance_scale: float) -> float:
    """A recomputed x_{i+1}'s bound (docs/testing.md, "Batch and split rounding"): the velocity's
    difference between two forwards, within FLOAT32_TOLERANCE in float32 and scaled by the model
    dtype, amplified by CFG at scale s by up to 2s - 1, and carried into x_{i+1} with coefficients of
    about 1 at most (Euler's dt; a multistep solver's weights sum to it; an SDE step's mean moves
    with dt v)."""
    cfg = 1.0 if guidance_rule == "none" else max(1.0, 2 * abs(guidance_scale) - 1)
    return FLOAT32_TOLERANCE * dtype_factor(model_dtype) * cfg


@dataclass(frozen=True)
class Result:
    """The checks of one case's stream."""

    case: Case
    max_log_prob_error: float  # the largest |recomputed - streamed| log-prob (0 without stochastic steps)
    noise_bitwise: bool  # x_0 and every eps are the seed rule's draws
    max_latent_error: float  # the largest |recomputed - streamed| x_{i+1}
    final_latent_error: float  # that of the final latent
    log_prob_bound: float
    latent_bound: float

    @property
    def passed(self) -> bool:
        return (
            self.noise_bitwise
            and self.max_log_prob_error <= self.log_prob_bound
            and self.max_latent_error <= self.latent_bound
        )


def velocities_of(transformer, trajectories: Sequence, device: torch.device) -> torch.Tensor:
    """v_i after guidance at every step of one rollout's samples, [T, B, ...], recomputed with
    ``transformer`` (or the experts by component name) from the streamed x_i, by the stream's
    transformer-call rule, the rows of each branch in one call."""
    rows = []
    for i in range(trajectories[0].num_steps):
        x = torch.stack([t.latents[i] for t in trajectories]).to(device)
        v = guided_velocity(expert(transformer, trajectories[0], i), trajectories, i, x, device)
        rows.append(v.cpu())
    return torch.stack(rows)


@torch.no_grad()
def check(case: Case, events: Sequence, transformer=None, device: str | torch.device = "cpu") -> Result:
    """Check one case's stream (every latent and the debug tensors streamed). The velocities are the
    streamed VELOCITY debug tensors, or with ``transformer`` its own forwards on ``device``."""
    started = next(e for e in events if isinstance(e, Started))
    message, trajectories = started.message, collect(events)
    seeds, shape, streams = list(message.seeds), tuple(message.layout.shape), trajectories[0].streams
    stochastic = [e for e in events if isinstance(e, Step) and e.stochastic]
    drawn = {step.index: noise.step_noise(seeds, step.index, shape, streams) for step in stochastic}
    noise_bitwise = torch.equal(started.x0, noise.initial_noise(seeds, shape, streams))
    noise_bitwise &= all(torch.equal(step.debug["eps"], drawn[step.index]) for step in stochastic)
    if transformer is None:
        velocities = torch.stack([e.debug["velocity"] for e in events if isinstance(e, Step)])
    else:
        velocities = velocities_of(transformer, trajectories, torch.device(device))
    log_prob_errors, latent_errors = [], []
    for row, trajectory in enumerate(trajectories):
        eps = {i: noise_rows[row] for i, noise_rows in drawn.items()}
        log_probs, latents = _errors(trajectory, velocities[:, row], eps)
        log_prob_errors.append(log_probs)
        latent_errors.append(latents)
    log_prob_errors, latent_errors = torch.cat(log_prob_errors), torch.stack(latent_errors)
    call = trajectories[0].transformer_call
    scale = max((call.guidance_scale_at(i) for i in range(trajectories[0].num_steps)), key=abs)
    replayed_dtype = "float32" if transformer is None else call.model_dtype
    return Result(
        case=case,
        max_log_prob_error=float(log_prob_errors.max()) if log_prob_errors.numel() else 0.0,
        noise_bitwise=bool(noise_bitwise),
        max_latent_error=float(latent_errors.max()),
        final_latent_error=float(latent_errors[:, -1].max()),
        # The streamed velocities are the server's own numbers: only float32 step math differs then.
        log_prob_bound=log_prob_tolerance(replayed_dtype),
        latent_bound=latent_tolerance(replayed_dtype, call.guidance_rule, scale),
    )


def _errors(trajectory, velocities: torch.Tensor, eps: Mapping[int, torch.Tensor]):
    """Each stochastic step's |recomputed - streamed| log-prob of the streamed x_{i+1} (and each latent
    stream's own), and each step's largest |recomputed - streamed| x_{i+1} [T]: a deterministic step's
    by the solver, a stochastic step's as mean + sd eps, from the streamed x_i and ``velocities``."""
    regenerated = regenerate_deterministic_steps(trajectory, velocities)
    log_prob_errors, constants = [], trajectory.log_prob_constants
    for i in eps:
        kind, level, sigmas = trajectory.sampler_type, trajectory.noise_level_at(i), trajectory.sigmas
        x, v = trajectory.latents[i].unsqueeze(0), velocities[i].unsqueeze(0)
        mean, sd = (
            steps.transition_mean(kind, x, v, sigmas, i, level),
            steps.noise_std(kind, sigmas, i, level),
        )
        regenerated[i] = (mean + sd * eps[i])[0]
        residual = trajectory.latents[i + 1].unsqueeze(0) - mean
        log_prob_errors.append(steps.log_prob(residual, sd, constants)[0] - trajectory.log_probs[i])
        if trajectory.streams:
            own = steps.stream_log_probs(residual, sd, constants, trajectory.streams)
            log_prob_errors += [
                own[name][0] - value[i] for name, value in trajectory.stream_log_probs.items()
            ]
    latent_errors = (regenerated - trajectory.latents[1:]).abs().flatten(1).amax(dim=1)
    return (torch.stack(log_prob_errors).abs() if log_prob_errors else torch.zeros(0)), latent_errors


def table(results: Sequence[Result]) -> str:
    """One row per case: max |dlogp|, noise bitwise, the final latent's and any step's largest
    difference, and whether it passed."""
    header = ("sampler", "cfg", "window", "max |dlogp|", "noise bitwise", "final |dx|", "max |dx|", "result")
    rows = [
        (
            r.case.sampler,
            r.case.cfg_name,
            r.case.window_name,
            f"{r.max_log_prob_error:.2e}",
            "yes" if r.noise_bitwise else "NO",
            f"{r.final_latent_error:.2e}",
            f"{r.max_latent_error:.2e}",
            "pass" if r.passed else "FAIL",
        )
        for r in results
    ]
    widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
    lines = (
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in (header, *rows)
    )
    return "\n".join(line.rstrip() for line in lines)
