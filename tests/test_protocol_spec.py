"""docs/protocol.md's specification of a rollout's numbers, written out from the text and held to the code.

Every ``spec_`` function is a formula of "The numbers: a specification" as the page writes it (the
comment above each group names its section). None of them calls rollout_core's step math, noise,
solvers or call, which the tests hold them to. The float32 ones follow the page's order of
operations, with torch's CPU log, exp, expm1 and sin on 0-d tensors, as its section 1 says; where the
page says bitwise the comparison is bitwise: the same IEEE float32 operations in the same order, each
rounded once, give the same bits (docs/testing.md's "Reference formula" at its strictest). The page
leaves the order of a mean over a latent's elements open, so the log-probs are compared with a
float64 mean of the terms, within the bound derived next to the assertion.
"""

import math

import pytest
import torch

from rollout.v1 import rollout_pb2
from rollout_core import noise, steps
from rollout_core.latent_streams import LatentStream
from rollout_core.transformer_call import (
    CallForm,
    LatentConditioning,
    TransformerCall,
    apply_guidance,
    call_transformer,
    stack_envs,
)
from rollout_core.tree import Tree
from rollout_server import sampler
from rollout_server.runner import env_signature

U = 2.0**-24  # float32's unit roundoff
MASK = 2**64 - 1
STREAMS = (
    LatentStream("video", (6, 4), "hidden_states"),
    LatentStream("audio", (5, 3), "audio_hidden_states"),
)
# Two schedules of 8 steps: from 1 (FlowGRPO's first step; log-SNR -inf) and from 0.95 (the first-step
# rule below 1), each falling unevenly, as shifted schedules do.
SCHEDULES = {
    "from 1": [1.0, 0.97, 0.9, 0.78, 0.6, 0.41, 0.22, 0.08, 0.0],
    "from 0.95": [0.95, 0.8, 0.71, 0.55, 0.43, 0.3, 0.16, 0.05, 0.0],
}
WINDOW = [3, 4]  # the stochastic steps: an SDE window in the middle of the deterministic ones


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


# Section 6: seeds and noise.


def spec_splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def spec_seeds(base_seed: int, count: int) -> list[int]:
    return [spec_splitmix64((base_seed + k) & MASK) for k in range(count)]


def spec_draw(seed: int, j: int, shapes: list[tuple[int, ...]]) -> torch.Tensor:
    """Noise stream j of one sample: stream l at its shape from noise_seed(S, j, l), the joint of them
    flattened in order where there are several."""
    parts = []
    for stream, shape in enumerate(shapes):
        generator = torch.Generator("cpu").manual_seed(
            spec_splitmix64(seed ^ spec_splitmix64(j + stream * 2**32))
        )
        parts.append(torch.randn(shape, generator=generator, dtype=torch.float32))
    return parts[0] if len(parts) == 1 else torch.cat([part.flatten() for part in parts])


def spec_child_seed(seed: int, step: int, child: int) -> int:
    return seed if child == 0 else spec_splitmix64(seed ^ spec_splitmix64(2**63 + step * 2**32 + child))


# Section 5: the stochastic transitions.


def spec_transition(kind: str, sigmas: torch.Tensor, i: int, a: float, x, v):
    """(mean, sd) of step i, float32 in the page's order."""
    s, s_next, a = sigmas[i], sigmas[i + 1], f32(a)
    dt = s_next - s
    if kind in ("FLOW_SDE", "DANCE"):
        if kind == "FLOW_SDE":
            s_hat = sigmas[1] if i == 0 else s  # the first-step rule
            std_t = a * torch.sqrt(s / (1 - s_hat))
        else:
            std_t = a
        c_x = 1 + ((std_t * std_t) / (2 * s)) * dt
        c_v = (1 + ((std_t * std_t) * (1 - s)) / (2 * s)) * dt
        return (x * c_x) + (v * c_v), std_t * torch.sqrt(s - s_next)
    sd = s_next * torch.sin(a * f32(math.pi / 2))
    x0, x1 = x - s * v, x + (1 - s) * v
    return ((1 - s_next) * x0) + (torch.sqrt((s_next * s_next) - (sd * sd)) * x1), sd


# Section 8: the deterministic solvers. ``run`` holds (m_j, p_j, xc_j) of the run's earlier steps.


def spec_lambda(s: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - s) - torch.log(s)


def spec_solver_step(solver: str, sigmas: torch.Tensor, i: int, x, v, run: list):
    """(x', p_i, m_i, xc_i) of deterministic step i."""
    num_steps, n = len(sigmas) - 1, len(run)
    s, s_next = sigmas[i], sigmas[i + 1]
    if solver == "euler":
        return x + (s_next - s) * v, 1, None, None
    m = x - s * v
    if solver == "dpmpp_2m":
        p = 2 if n >= 1 and i < num_steps - 1 else 1
        h = spec_lambda(s_next) - spec_lambda(s)
        c = (1 - s_next) * (torch.exp(-h) - 1)
        out = ((s_next / s) * x) - (c * m)
        if p == 2:
            r = (spec_lambda(s) - spec_lambda(sigmas[i - 1])) / h
            out = out - ((0.5 * c) * ((1 / r) * (m - run[-1][0])))
        return out, p, m, None
    p = min(2, num_steps - i, n + 1)
    xc = x
    if n >= 1:  # the corrector, from xc_{i-1}
        (m_prev, q, xc_prev), s_prev = run[-1], sigmas[i - 1]
        h = spec_lambda(s) - spec_lambda(s_prev)
        phi = torch.expm1(-h)
        g1 = (phi / (-h)) - 1
        b1 = g1 / phi
        xc = ((s / s_prev) * xc_prev) - (((1 - s) * phi) * m_prev)
        if q == 1:
            xc = xc - (((1 - s) * phi) * (0.5 * (m - m_prev)))
        else:
            b2 = (((g1 / (-h)) - 0.5) * 2) / phi
            r = (spec_lambda(sigmas[i - 2]) - spec_lambda(s_prev)) / h
            if torch.isinf(r):
                rho0, rhoc = f32(0.0), b1
            else:
                rho0, rhoc = torch.linalg.solve(torch.tensor([[1.0, 1.0], [r, 1.0]]), torch.stack([b1, b2]))
            d = (run[-2][0] - m_prev) / r
            xc = xc - (((1 - s) * phi) * ((rho0 * d) + (rhoc * (m - m_prev))))
    h = spec_lambda(s_next) - spec_lambda(s)
    phi = torch.expm1(-h)
    out = ((s_next / s) * xc) - (((1 - s_next) * phi) * m)
    if p == 2:
        r = (spec_lambda(sigmas[i - 1]) - spec_lambda(s)) / h
        out = out - (((1 - s_next) * phi) * (0.5 * ((run[-1][0] - m) / r)))
    return out, p, m, xc


def spec_round(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y if dtype == torch.float32 else y.to(dtype).float()


# Section 7: the log-prob's elementwise terms, in float64 (the page leaves the mean's order open).


def spec_log_prob_terms(residual: torch.Tensor, sd: torch.Tensor, constants: bool):
    """(terms, magnitudes): float64 terms l, and per element the magnitude A that bounds the float32
    rounding of its computation (see assert_log_probs)."""
    r, sd = residual.double(), sd.double()
    if not constants:
        return -(r * r), r * r
    half_square = (r / sd) ** 2 / 2
    c = math.log(math.sqrt(2 * math.pi))
    return -half_square - torch.log(sd) - c, half_square + torch.log(sd).abs() + c


def velocity_field(i: int, x: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model's guided velocity: a smooth function of x, other at every step."""
    generator = torch.Generator().manual_seed(100 + i)
    weight, bias = torch.randn(2, *x.shape[1:], generator=generator)
    return torch.tanh(x) * weight + bias


def test_seeds_noise_and_child_seeds_are_section_6():
    """The seeds of a base seed (wrapping past 2^64), x_0 and eps of one and of two latent streams, and
    a tree's seeds and node ids are the page's rule, bitwise: the same generator from the same seed."""
    base = 2**64 - 2
    seeds = spec_seeds(base, 4)
    assert seeds == noise.derive_seeds(base, 4)
    assert len(set(seeds)) == 4
    shape = (3, 4, 4)
    for j in (0, 1, 7):
        expected = torch.stack([spec_draw(seed, j, [shape]) for seed in seeds])
        assert torch.equal(noise.draw(seeds, j, shape), expected)
        joint = torch.stack([spec_draw(seed, j, [stream.shape for stream in STREAMS]) for seed in seeds])
        assert torch.equal(noise.draw(seeds, j, (39,), STREAMS), joint)
        # Stream 0 of a joint latent draws what a one-latent sample of its shape draws.
        assert torch.equal(joint[:, :24], torch.stack([spec_draw(s, j, [(6, 4)]) for s in seeds]).flatten(1))
    # Roots are the samples; each depth's children follow, in their parents' order and by c.
    tree = Tree.grow(seeds[:2], [0, 0], [(1, 2), (3, 3)], num_steps=5)
    frontier = list(enumerate(seeds[:2]))
    expected = [(k, -1, seed) for k, seed in frontier]
    for step, factor in ((1, 2), (3, 3)):
        children = []
        for parent_id, parent_seed in frontier:
            for c in range(factor):
                children.append((len(expected), spec_child_seed(parent_seed, step, c)))
                expected.append((len(expected), parent_id, children[-1][1]))
        frontier = children
    assert [(node.id, node.parent, node.seed) for node in tree.nodes] == expected


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind, a", [("FLOW_SDE", 0.7), ("FLOW_SDE", 3.0), ("DANCE", 0.7), ("CPS", 0.5)])
def test_each_samplers_mean_and_sd_are_section_5(kind, a, schedule):
    """Every step's mean and sd on random latents and velocities are the page's formulas, bitwise; on
    the schedule from 0.95, FLOW_SDE's first step takes s_1 in the denominator, not s_0."""
    sigmas = torch.tensor(SCHEDULES[schedule])
    generator = torch.Generator().manual_seed(0)
    for i in range(len(sigmas) - 1):
        x, v = torch.randn(2, 2, 3, 4, 4, generator=generator)
        mean, sd = spec_transition(kind, sigmas, i, a, x, v)
        assert torch.equal(steps.transition_mean(kind, x, v, sigmas, i, a), mean), f"step {i}"
        assert torch.equal(steps.noise_std(kind, sigmas, i, a), sd), f"step {i}"
    if kind == "FLOW_SDE" and schedule == "from 0.95":
        s0, s1 = sigmas[0], sigmas[1]
        assert steps.noise_std(kind, sigmas, 0, a) == f32(a) * torch.sqrt(s0 / (1 - s1)) * torch.sqrt(s0 - s1)
        # FlowGRPO's formula read literally where s_0 < 1 takes 1 - s_0: sqrt(0.2 / 0.05) = 2 times as much.
        literal = f32(a) * torch.sqrt(s0 / (1 - s0)) * torch.sqrt(s0 - s1)
        assert steps.noise_std(kind, sigmas, 0, a) < 0.6 * literal


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("solver", ["euler", "dpmpp_2m", "unipc"])
@pytest.mark.parametrize(
    "kind, latent_dtype, streams",
    [
        ("FLOW_SDE", torch.float32, ()),
        ("DANCE", torch.bfloat16, ()),
        ("CPS", torch.float32, STREAMS),
        ("FLOW_SDE", torch.float16, STREAMS),
        ("ODE", torch.float32, ()),
    ],
)
def test_a_rollout_is_sections_4_to_8(kind, latent_dtype, streams, solver, schedule):
    """A rollout of the server's sampler around an SDE window (steps 3 and 4 of 8) against the page:
    which steps are stochastic (4), x_0 and every eps (6), the transitions (5) and the solver's steps
    with their orders and a history that restarts after the window (8), each latent bitwise; the joint
    and per-stream log-probs (7) within their derived bound."""
    sigmas = torch.tensor(SCHEDULES[schedule])
    num_steps = len(sigmas) - 1
    levels = [0.8] * num_steps
    requested = [] if kind == "ODE" else WINDOW
    constants = kind != "CPS"
    seeds = spec_seeds(5, 2)
    shapes = [stream.shape for stream in streams] or [(3, 4, 4)]
    latent_shape = (sum(math.prod(shape) for shape in shapes),) if streams else shapes[0]

    def spec_stochastic(chosen: list[int]) -> list[bool]:
        """Section 4: a stochastic sampler, a requested step (all where none are), and sd > 0."""
        return [
            kind != "ODE"
            and (not chosen or i in chosen)
            and bool(spec_transition(kind, sigmas, i, levels[i], 0, 0)[1] > 0)
            for i in range(num_steps)
        ]

    # Every step requested: CPS's last step, into s_T = 0, has sd 0 and is deterministic.
    assert sampler.stochastic_steps(kind, sigmas, levels, []) == spec_stochastic([])
    stochastic = sampler.stochastic_steps(kind, sigmas, levels, requested)
    assert stochastic == spec_stochastic(requested)
    plan = sampler.SamplerPlan(
        kind,
        sigmas,
        stochastic,
        solver,
        levels,
        constants,
        latent_dtype,
        seeds,
        latent_shape,
        torch.device("cpu"),
        latent_streams=streams,
    )
    state = sampler.init(plan)
    x = spec_round(torch.stack([spec_draw(seed, 0, shapes) for seed in seeds]), latent_dtype)
    assert torch.equal(state.x, x)
    run, orders = [], []
    for i in range(num_steps):
        v = velocity_field(i, x)
        record = sampler.advance(plan, state, velocity_field(i, state.x))
        if stochastic[i]:
            mean, sd = spec_transition(kind, sigmas, i, levels[i], x, v)
            eps = torch.stack([spec_draw(seed, i + 1, shapes) for seed in seeds])
            scaled = sd * eps
            x_next = spec_round(mean + scaled, latent_dtype)
            residual = scaled if latent_dtype == torch.float32 else x_next - mean
            assert torch.equal(record.eps, eps) and torch.equal(record.sd, sd), f"step {i}"
            assert_log_probs(record, residual, sd, constants, streams)
            run, order = [], 1  # the noise ends the history: the next deterministic step starts a run
        else:
            out, order, m, xc = spec_solver_step(solver, sigmas, i, x, v, run)
            x_next = spec_round(out, latent_dtype)
            run.append((m, order, xc))
            assert record.log_probs is None
        assert torch.equal(record.x_next, x_next), f"step {i}"
        assert record.order == order, f"step {i}"
        orders.append(order)
        x = x_next
    assert plan.step_orders == orders
    if kind != "ODE" and solver != "euler":
        assert orders[5] == 1 and orders[6] == 2  # restarted after the window, then warmed up again


def assert_log_probs(record, residual, sd, constants, streams):
    """The joint log-prob of each row, and each stream's, against the float64 mean of the page's
    terms. Each float32 term takes at most 8 roundings of relative size u on quantities no larger than
    its magnitude A = (r / sd)^2 / 2 + |log sd| + log(sqrt(2 pi)) (r^2 without constants): r / sd
    and its square 3, log(sd) within 2, the two subtractions 2, the constant's rounding 1. A float32
    sum of n terms adds at most (n - 1) u times their absolute sum, the division by n one more u: in
    all at most (n + 8) u mean(A)."""
    terms, magnitudes = spec_log_prob_terms(residual.flatten(1), sd, constants)
    cuts = {"joint": (0, terms.shape[1])}
    offset = 0
    for stream in streams:
        cuts[stream.name] = (offset, offset + math.prod(stream.shape))
        offset = cuts[stream.name][1]
    assert set(record.stream_log_probs) == {stream.name for stream in streams}
    for name, (start, end) in cuts.items():
        got = record.log_probs if name == "joint" else record.stream_log_probs[name]
        expected = terms[:, start:end].mean(dim=1)
        bound = (end - start + 8) * U * magnitudes[:, start:end].mean(dim=1)
        assert got.dtype == torch.float32
        assert ((got.double() - expected).abs() <= bound).all(), (name, got, expected, bound)


# Section 2: the transformer call.


class Probe(torch.nn.Module):
    """A transformer of any call form: each row's prediction is its latents scaled by its fed timestep
    plus the mean of every tensor the row is handed, each at a weight of its own, so an input fed
    otherwise than a rule says (another row's, another dtype, another timestep) changes the numbers.
    Per-sample forms (a list of latents) get a list back."""

    def __init__(self, latents_argument: str, timestep_argument: str):
        super().__init__()
        self.latents_argument, self.timestep_argument = latents_argument, timestep_argument

    def forward(self, **inputs):
        latents, t = inputs.pop(self.latents_argument), inputs.pop(self.timestep_argument)
        rows = latents if isinstance(latents, list) else list(latents)
        # One timestep per row, or (a packed sample) one per token of its one row.
        fed = list(t.float()) if t.numel() == len(rows) else [t.float().sum()]
        predictions = []
        for b, row in enumerate(rows):
            context = sum(
                (k + 1) * self._row(value, b, len(rows), isinstance(latents, list)).float().mean()
                for k, (_, value) in enumerate(sorted(inputs.items()))
                if isinstance(value, (torch.Tensor, list))
            )
            predictions.append((row.float() * (1 + fed[b]) + context).to(row.dtype))
        return (predictions if isinstance(latents, list) else torch.stack(predictions),)

    @staticmethod
    def _row(value, b: int, rows: int, per_sample: bool):
        if isinstance(value, list):
            return value[b]
        if rows > 1 and value.shape[0] == rows:
            if per_sample:
                raise TypeError("a per-sample call takes a batched tensor as the list of its rows")
            return value[b]
        return value


def spec_stack(envs: list[dict], batched: tuple[str, ...]) -> dict:
    """E: each batched tensor concatenated along dim 0 (a batched list: the lists concatenated), every
    other entry row 0's."""
    stacked = {}
    for key, value in envs[0].items():
        if key not in batched or value is None:
            stacked[key] = value
        elif isinstance(value, torch.Tensor):
            stacked[key] = torch.cat([env[key] for env in envs])
        else:
            stacked[key] = [item for env in envs for item in env[key]]
    return stacked


def spec_velocity(transformer, call: TransformerCall, x: torch.Tensor, t: torch.Tensor, env: dict):
    """One branch's velocity by the page's rule, from the stacked env E."""
    form, model_dtype = call.form, getattr(torch, call.model_dtype)
    o, d = form.timestep_offset, call.timestep_divisor
    tau = (o - t) / d if form.timestep_reversed else (t - o) / d
    tau = tau if form.timestep_float32 else tau.to(model_dtype)
    env, h = dict(env), x.to(model_dtype)
    if call.conditioning.concat in (
        rollout_pb2.CONDITIONING_CONCAT_SEQUENCE,
        rollout_pb2.CONDITIONING_CONCAT_CHANNELS,
    ):
        h = torch.cat([h, env.pop(call.conditioning.env_key).to(model_dtype)], dim=1)
    timesteps = {form.timestep_argument: tau, **{name: tau for name in form.timestep_copies}}
    batched = {
        k for k, value in env.items() if k in call.batched_env_keys and isinstance(value, torch.Tensor)
    }
    if form.inputs == rollout_pb2.TRANSFORMER_INPUTS_BATCHED:
        p = transformer(**{form.latents_argument: h}, **timesteps, **env)[0]
    elif form.inputs == rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES:
        rows = {k: [value[b] for b in range(len(x))] if k in batched else value for k, value in env.items()}
        latents = [h[b].unsqueeze(1) for b in range(len(x))]
        p = torch.stack(transformer(**{form.latents_argument: latents}, **timesteps, **rows)[0]).squeeze(2)
    else:  # PACKED_SAMPLE
        parts = []
        for b in range(len(x)):
            row = {k: value[b] if k in batched else value for k, value in env.items()}
            tokens = tau[b].repeat(row[form.timestep_tokens_key].numel())
            parts.append(
                transformer(**{form.latents_argument: [h[b : b + 1]], form.timestep_argument: tokens}, **row)[
                    0
                ][0]
            )
        p = torch.cat(parts)
    v = p[:, : x.shape[1]].float()
    return -v if form.negated_prediction else v


def spec_guidance(rule: str, g: float, v: dict) -> torch.Tensor:
    if rule == "none":
        return v["positive"]
    if rule == "cfg_from_positive":
        return v["positive"] + g * (v["positive"] - v["negative"])
    c = v["negative"] + g * (v["positive"] - v["negative"])
    if rule == "true_cfg":
        return c
    # The page leaves the norm's order open: torch's, as the server's, on the same shape.
    return c * (torch.norm(v["positive"], dim=-1, keepdim=True) / torch.norm(c, dim=-1, keepdim=True))


SEQUENCE = LatentConditioning(rollout_pb2.CONDITIONING_CONCAT_SEQUENCE, "image_latents")
NONE = LatentConditioning()
# (form, conditioning, model dtype, divisor, one sample's latent, per-row env maker, batched keys)
CALLS = {
    "batched, conditioning on the sequence, a timestep copy": (
        CallForm(timestep_copies=("sigma",)),
        SEQUENCE,
        "bfloat16",
        1000.0,
        (6, 4),
        lambda g: {
            "image_latents": torch.randn(1, 3, 4, generator=g),
            "context": torch.randn(1, 5, 4, generator=g),
            "ids": torch.arange(10.0).reshape(5, 2),
            "return_dict": False,
        },
        ("image_latents", "context"),
    ),
    "per-sample frames, offset reversed, float32, negated (Z-Image's)": (
        CallForm(rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES, "x", "t", 1000.0, True, True, True),
        NONE,
        "bfloat16",
        1000.0,
        (4, 3, 3),
        lambda g: {"cap_feats": torch.randn(1, 7, 4, generator=g), "return_dict": False},
        ("cap_feats",),
    ),
    "packed samples, a timestep per token (Cosmos3's)": (
        CallForm(
            rollout_pb2.TRANSFORMER_INPUTS_PACKED_SAMPLE,
            "vision_tokens",
            "vision_timesteps",
            timestep_float32=True,
            timestep_tokens_key="noisy",
        ),
        NONE,
        "float32",
        1.0,
        (6, 4),
        lambda g: {
            "input_ids": torch.randn(1, 4, generator=g),
            "noisy": torch.arange(3.0)[None],
            "frames": torch.ones(1, 2),
            "und_len": 4,
            "return_dict": False,
        },
        ("input_ids", "noisy"),
    ),
}


@pytest.mark.parametrize("case", CALLS)
def test_the_transformer_call_and_guidance_are_section_2(case):
    """call_transformer and apply_guidance compute, bitwise, what the page's rule computes: the same
    torch operations on the same inputs (the stacked env included), so any difference is one of the
    rule's fields read otherwise; two rows at different steps, each fed its own timestep."""
    form, conditioning, model_dtype, divisor, shape, env_of, batched = CALLS[case]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, *shape, generator=generator)
    t = torch.tensor([937.3, 251.7])  # t / 1000 not a bfloat16 number: the cast shows
    transformer = Probe(form.latents_argument, form.timestep_argument)
    velocities = {}
    for branch in ("positive", "negative"):
        envs = [env_of(generator) for _ in range(2)]
        stacked = stack_envs(envs, batched)
        expected = spec_stack(envs, batched)
        assert stacked.keys() == expected.keys()
        assert all(
            torch.equal(stacked[k], v) if isinstance(v, torch.Tensor) else stacked[k] == v
            for k, v in expected.items()
        )
        call = TransformerCall(
            "Probe",
            model_dtype,
            divisor,
            "",
            "true_cfg",
            1.0,
            ("positive", "negative"),
            batched,
            conditioning,
            form,
        )
        velocities[branch] = call_transformer(
            transformer, x, t, stacked, getattr(torch, model_dtype), divisor, conditioning, form, batched
        )
        assert torch.equal(velocities[branch], spec_velocity(transformer, call, x, t, expected)), branch
    scales = (4.5, 4.5, 3.0)  # Wan 2.2's: one per step
    for rule in ("none", "true_cfg", "true_cfg_norm_rescale", "cfg_from_positive"):
        for listed in ((), scales):
            call = TransformerCall(
                "Probe",
                model_dtype,
                divisor,
                "",
                rule,
                4.5,
                ("positive", "negative"),
                batched,
                guidance_rule_scales=listed,
            )
            for i in range(3):
                g = listed[i] if listed else call.guidance_rule_scale
                assert torch.equal(
                    apply_guidance(rule, call.guidance_scale_at(i), velocities),
                    spec_guidance(rule, g, velocities),
                )


def spec_share_a_call(env: dict, other: dict, batched: tuple[str, ...]) -> bool:
    """Section 9's env signature: over every key, a batched tensor's dtype and shape, a shared
    tensor's dtype, shape and bytes, a batched list's length, any other value itself."""
    if env.keys() != other.keys():
        return False
    for key, value in env.items():
        theirs = other[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(theirs, torch.Tensor) or (value.dtype, value.shape) != (
                theirs.dtype,
                theirs.shape,
            ):
                return False
            if key not in batched and not torch.equal(value, theirs):
                return False
        elif key in batched and value is not None:
            if not isinstance(theirs, list) or len(value) != len(theirs):
                return False
        elif value != theirs:
            return False
    return True


def test_rows_share_a_call_by_section_9():
    """The server's env signatures are equal exactly where the page's rule lets two rows share a call:
    a batched tensor's values may differ, its shape not (a text of another length); a shared tensor, a
    value of env_json (Cosmos3's und_len) or a batched list's length may not."""
    generator = torch.Generator().manual_seed(4)
    batched = ("context", "shapes")
    env = {
        "context": torch.randn(1, 5, 4, generator=generator),
        "ids": torch.zeros(5, 2),
        "und_len": 5,
        "shapes": [(1, 2, 2)],
        "return_dict": False,
    }
    variants = {
        "the same": ({}, True),
        "another prompt of the same length": ({"context": torch.randn(1, 5, 4, generator=generator)}, True),
        "a text of another length": ({"context": torch.randn(1, 6, 4, generator=generator)}, False),
        "another dtype of a batched tensor": ({"context": env["context"].double()}, False),
        "other shared values": ({"ids": torch.ones(5, 2)}, False),
        "another und_len": ({"und_len": 6}, False),
        "a batched list of another length": ({"shapes": [(1, 2, 2), (1, 2, 2)]}, False),
    }
    for name, (change, shares) in variants.items():
        other = {**env, **change}
        assert spec_share_a_call(env, other, batched) == shares, name
        assert (env_signature(env, batched) == env_signature(other, batched)) == shares, name
