"""Independent float64 NumPy reference of the step formulas (docs/design.md, invariant 2); it shares
no code with the sampler."""

import math

import numpy as np
import torch

from rollout.v1 import rollout_pb2


def mean_and_sd(kind: str, x: np.ndarray, v: np.ndarray, sigmas: np.ndarray, i: int, a: float):
    s, s1 = float(sigmas[i]), float(sigmas[i + 1])
    dt = s1 - s
    if kind in ("FLOW_SDE", "DANCE"):
        if kind == "FLOW_SDE":
            s_hat = float(sigmas[1]) if i == 0 else s  # FlowGRPO: s == 1; Wan starts at 1 - 1e-6
            std_t = a * math.sqrt(s / (1 - s_hat))
        else:
            std_t = a
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return mean, std_t * math.sqrt(-dt)
    if kind == "CPS":
        sd = s1 * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return (1 - s1) * x0 + math.sqrt(s1**2 - sd**2) * x1, sd
    return x + dt * v, 0.0


def log_prob(x_next: np.ndarray, mean: np.ndarray, sd: float, constants: bool) -> np.ndarray:
    axes = tuple(range(1, x_next.ndim))
    squared = (x_next - mean) ** 2
    if constants:
        return (-squared / (2 * sd**2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))).mean(axes)
    return (-squared).mean(axes)


def guidance(rule: str, scale: float, v: dict[str, np.ndarray]) -> np.ndarray:
    """The branch combination rules, float64."""
    if rule == "none":
        return v["positive"]
    if rule == "cfg_from_positive":
        return v["positive"] + scale * (v["positive"] - v["negative"])
    combined = v["negative"] + scale * (v["positive"] - v["negative"])
    if rule == "true_cfg":
        return combined
    assert rule == "true_cfg_norm_rescale", rule
    norm = np.linalg.norm(v["positive"], axis=-1, keepdims=True) / np.linalg.norm(
        combined, axis=-1, keepdims=True
    )
    return combined * norm


def bare_velocity(model, x, timestep, env, call) -> np.ndarray:
    """One branch's float64 velocity from a bare forward, as rollout.proto's TransformerCall states the
    rule: the conditioning latents (SEQUENCE, CHANNELS) appended to x on dim 1 and the prediction cut
    back to x's part; per-sample inputs (Z-Image) as lists, each sample with a frame axis at dim 1 and
    the batched env tensors row by row; a packed sample (Cosmos3) one call per sample, with its rows of
    the batched env tensors and a timestep per token; several latent streams (LTX-2) as consecutive
    pieces of each row, each under its own argument, and the outputs put back in the same order; the
    timestep also under each of ``timestep_copies``; the prediction negated where the call says so."""
    if call.form.inputs == rollout_pb2.TRANSFORMER_INPUTS_PACKED_SAMPLE:
        rows = [
            {key: value[b] if key in call.batched_env_keys else value for key, value in env.items()}
            for b in range(len(x))
        ]
        return np.concatenate(
            [packed_sample_velocity(model, x[b : b + 1], timestep, rows[b], call) for b in range(len(x))]
        )
    env = dict(env)
    timesteps = {name: timestep for name in (call.form.timestep_argument, *call.form.timestep_copies)}
    if call.form.streams:
        inputs, offset = {}, 0
        for stream in call.form.streams:
            size = math.prod(stream.shape)
            inputs[stream.argument] = x[:, offset : offset + size].reshape(len(x), *stream.shape)
            offset += size
        assert offset == x.shape[1]
        outputs = model(**inputs, **timesteps, **env)
        v = np.concatenate(
            [output.double().numpy().reshape(len(x), -1) for output in outputs[: len(call.form.streams)]],
            axis=1,
        )
        return -v if call.form.negated_prediction else v
    latents = x
    if call.conditioning.env_key:
        latents = torch.cat([x, env.pop(call.conditioning.env_key)], dim=1)
    per_sample = call.form.inputs == rollout_pb2.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES
    if per_sample:
        latents = [sample[:, None] for sample in latents]
        env = {key: list(value) if key in call.batched_env_keys else value for key, value in env.items()}
    prediction = model(**{call.form.latents_argument: latents}, **timesteps, **env)[0]
    if per_sample:
        prediction = torch.stack([sample[:, 0] for sample in prediction])
    v = prediction[:, : x.shape[1]].double().numpy()
    return -v if call.form.negated_prediction else v


def packed_sample_velocity(model, x, timestep, row, call) -> np.ndarray:
    """One sample's float64 velocity through a transformer that packs its text and latents into one
    sequence: ``row``, the sample's env (its rows of the batched tensors), its latents as a list of
    one, the timestep once per element of row[timestep_tokens_key], the prediction the list's one
    tensor."""
    tokens = row[call.form.timestep_tokens_key].numel()
    timestep = torch.full((tokens,), float(timestep.reshape(-1)[0]), dtype=torch.float32)
    inputs = {call.form.latents_argument: [x], call.form.timestep_argument: timestep}
    v = model(**inputs, **row)[0][0].double().numpy()
    return -v if call.form.negated_prediction else v


def bare_log_probs(transformer, trajectory) -> dict[int, float]:
    """A trainer's replay written from scratch: a bare diffusers forward with the streamed env, and the
    float64 formulas above. Returns {step: log-prob} for every stochastic step."""
    call = trajectory.transformer_call
    replayed = {}
    for i in torch.nonzero(trajectory.stochastic).flatten().tolist():
        x = trajectory.latents[i].unsqueeze(0)
        t, offset = torch.full((1,), trajectory.timesteps[i].item()), call.form.timestep_offset
        timestep = ((offset - t) if call.form.timestep_reversed else (t - offset)) / call.timestep_divisor
        # Wan 2.2: the expert the started event names for this step.
        model = transformer[trajectory.step_transformers[i]] if isinstance(transformer, dict) else transformer
        with torch.no_grad():
            v = {
                branch: bare_velocity(model, x, timestep, env, call) for branch, env in trajectory.env.items()
            }
        # Wan 2.2: the scale of this step's expert, when the call lists one per step.
        scale = call.guidance_rule_scales[i] if call.guidance_rule_scales else call.guidance_rule_scale
        velocity = guidance(call.guidance_rule, scale, v)
        sigmas = trajectory.sigmas.double().numpy()
        mean, sd = mean_and_sd(
            trajectory.sampler_type, x.double().numpy(), velocity, sigmas, i, trajectory.noise_level_at(i)
        )
        x_next = trajectory.latents[i + 1].unsqueeze(0).double().numpy()
        replayed[i] = float(log_prob(x_next, mean, sd, trajectory.log_prob_constants)[0])
    return replayed


def _half_log_snr(s: float) -> float:
    """lambda = log((1 - s) / s): -inf at s = 1, inf at s = 0."""
    if s == 0.0:
        return math.inf
    return -math.inf if s == 1.0 else math.log((1 - s) / s)


def solver_steps(solver: str, latents, velocities, sigmas, stochastic) -> dict[int, np.ndarray]:
    """{step: x_{i+1}} of every deterministic step in float64, from the given x_i and v_i of every
    step, by the published rules: Euler; DPM-Solver++(2M) (Lu et al. 2022, midpoint form, first order
    at the first step and into sigma = 0); UniPC-2 bh2 (Zhao et al. 2023) with its corrector on the
    sample a deterministic step made, the 2 x 2 system solved in closed form. A stochastic step
    starts the solver over: the steps after it read no earlier data prediction x - s v."""
    xs = [np.asarray(x, dtype=np.float64) for x in latents]
    vs = [np.asarray(v, dtype=np.float64) for v in velocities]
    s = [float(value) for value in sigmas]
    lam = [_half_log_snr(value) for value in s]
    T = len(stochastic)
    m = [xs[i] - s[i] * vs[i] for i in range(T)]
    out, corrected, orders, run = {}, {}, {}, 0  # run: deterministic steps since the last stochastic
    for i in range(T):
        if stochastic[i]:
            orders[i], run = 1, 0
            continue
        known, run = run, run + 1
        h = lam[i + 1] - lam[i]
        alpha_next = 1 - s[i + 1]
        decay = math.expm1(-h)  # e^-h - 1
        if solver == "euler":
            out[i] = xs[i] + (s[i + 1] - s[i]) * vs[i]
            continue
        if solver == "dpmpp_2m":
            x = s[i + 1] / s[i] * xs[i] - alpha_next * decay * m[i]
            if known and i < T - 1:
                r = (lam[i] - lam[i - 1]) / h
                x = x - 0.5 * alpha_next * decay * (m[i] - m[i - 1]) / r
            out[i] = x
            continue
        assert solver == "unipc", solver
        x = xs[i]
        if known:  # correct the sample step i - 1 made
            hc = lam[i] - lam[i - 1]
            phi = math.expm1(-hc)
            b1 = (phi / -hc - 1) / phi
            b2 = 2 * ((phi / -hc - 1) / -hc - 0.5) / phi
            base = s[i] / s[i - 1] * corrected[i - 1] - (1 - s[i]) * phi * m[i - 1]
            if orders[i - 1] == 1:
                x = base - (1 - s[i]) * phi * 0.5 * (m[i] - m[i - 1])
            else:
                r = (lam[i - 2] - lam[i - 1]) / hc
                rho_0 = 0.0 if math.isinf(r) else (b1 - b2) / (1 - r)
                rho_c = b1 - rho_0
                d = (m[i - 2] - m[i - 1]) / r
                x = base - (1 - s[i]) * phi * (rho_0 * d + rho_c * (m[i] - m[i - 1]))
        corrected[i] = x
        orders[i] = min(2, T - i, known + 1)
        x_next = s[i + 1] / s[i] * x - alpha_next * decay * m[i]
        if orders[i] == 2:
            r = (lam[i - 1] - lam[i]) / h
            x_next = x_next - alpha_next * decay * 0.5 * (m[i - 1] - m[i]) / r
        out[i] = x_next
    return out
