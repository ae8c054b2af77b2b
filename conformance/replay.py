"""The reference replayer of the rollout.v1 conformance vectors, written from docs/protocol.md alone: it
imports torch, safetensors, diffusers and the `rollout.v1` stubs (with protobuf), nothing of ours.

    python conformance/replay.py [--models DIR] [VECTOR_FILE ...]

Each case of a vector file (README.md: a rollout's request, started event and the stream's tensors a
replay needs) is checked with the file's model, DIR/<model> or DIR/<model>-<fingerprint> (DIR: the
preset cache): x_0 and eps drawn again by the seed rule, bitwise; each stochastic step's log-prob of the
stored x_{i+1}, replayed, within LOG_PROB_TOLERANCE; each latent the case stores, solved again from
the one before with the replay's own velocities, within latent_tolerance; the solver orders.
"""

import hashlib
import json
import math
import os
import re
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from pathlib import Path

import diffusers
import torch
from google.protobuf import json_format
from safetensors import safe_open
from safetensors.torch import load_file

from rollout.v1 import rollout_pb2 as pb

# Replay parity in float32 (docs/testing.md, "Replay"): the stored x_{i+1}'s rounding and the velocity's
# difference between two machines' forwards, each over sd, averaged over the latent's elements.
LOG_PROB_TOLERANCE = 1e-5
LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))
MASK64 = (1 << 64) - 1


def latent_tolerance(rule: str, scale: float) -> float:
    """A solved latent's bound (docs/testing.md, "Batch and split rounding"): two forwards' velocities
    differ by 1e-5 at most, CFG at scale s amplifies it by 2s - 1, and the steps carry it on with
    coefficients of about 1 (dt, or a multistep solver's weights, summing to at most 1)."""
    return LOG_PROB_TOLERANCE * (1.0 if rule == "none" else max(1.0, 2 * abs(scale) - 1))


def splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def draw(seeds, j: int, shape, streams) -> torch.Tensor:
    """Noise stream j (0: x_0, i + 1: eps of step i) of each seed (protocol.md 6); latent stream k draws
    its part from stream j + k 2^32 at its own shape, and the parts are flattened and joined."""
    rows, generator = [], torch.Generator("cpu")
    for seed in seeds:
        parts = []
        for k, part_shape in enumerate([s.shape for s in streams] or [shape]):
            generator.manual_seed(splitmix64(seed ^ splitmix64(j + (k << 32))))
            parts.append(torch.randn(tuple(part_shape), generator=generator, dtype=torch.float32))
        rows.append(torch.cat([p.flatten() for p in parts]) if streams else parts[0])
    return torch.stack(rows)


def sde_mean(x, v, s, s_next, std_t):
    dt = s_next - s
    return x * (1 + std_t * std_t / (2 * s) * dt) + v * ((1 + std_t * std_t * (1 - s) / (2 * s)) * dt)


def transition(sampler: str, x, v, sigmas, i: int, a: float):
    """(mean, sd) of stochastic step i, float32 (protocol.md 5)."""
    s, s_next, a = sigmas[i], sigmas[i + 1], torch.tensor(a)
    if sampler == "FLOW_SDE":
        s_hat = sigmas[1] if i == 0 else s  # the first step takes sigma_1, whatever sigma_0 is
        std_t = a * torch.sqrt(s / (1 - s_hat))
        return sde_mean(x, v, s, s_next, std_t), std_t * torch.sqrt(s - s_next)
    if sampler == "DANCE":
        return sde_mean(x, v, s, s_next, a), a * torch.sqrt(s - s_next)
    assert sampler == "CPS", sampler
    sd = s_next * torch.sin(a * (math.pi / 2))
    return (1 - s_next) * (x - s * v) + torch.sqrt(s_next**2 - sd**2) * (x + (1 - s) * v), sd


def log_prob(residual, sd, constants: bool) -> torch.Tensor:
    """Per row, the mean of the Gaussian log-density over its elements (-residual^2 without constants: 7)."""
    if constants:
        return (-((residual / sd) * (residual / sd)) / 2 - torch.log(sd) - LOG_SQRT_2PI).flatten(1).mean(1)
    return (-(residual * residual)).flatten(1).mean(1)


def lam(s):  # the half log-SNR log((1 - s) / s); m_j = x_j - s_j v_j is step j's data prediction
    return torch.log(1 - s) - torch.log(s)


def solver_order(solver: str, i: int, steps: int, known: int) -> int:
    if solver == "dpmpp_2m":
        return 2 if known and i < steps - 1 else 1
    return min(2, steps - i, known + 1) if solver == "unipc" else 1


def solve(solver: str, x, v, sigmas, i: int, history: dict):
    """(x_{i+1}, order) of deterministic step i in protocol.md 8's order of operations; ``history`` (the
    data predictions of the run's earlier steps, UniPC's corrected sample and last order) is updated."""
    s, s_next, ms = sigmas[i], sigmas[i + 1], history["m"]
    order = solver_order(solver, i, len(sigmas) - 1, len(ms))
    if solver == "euler":
        return x + (s_next - s) * v, order
    m, h = x - s * v, lam(s_next) - lam(s)
    if solver == "dpmpp_2m":
        c = (1 - s_next) * (torch.exp(-h) - 1)
        x_next = s_next / s * x - c * m
        if order == 2:
            x_next = x_next - 0.5 * c * ((1 / ((lam(s) - lam(sigmas[i - 1])) / h)) * (m - ms[-1]))
        history.update(m=[m])
        return x_next, order
    if ms:  # UniC: x_i corrected with m_i, at the previous step's order
        hc = lam(s) - lam(sigmas[i - 1])
        phi = torch.expm1(-hc)
        g1 = phi / -hc - 1
        xc = s / sigmas[i - 1] * history["corrected"] - (1 - s) * phi * ms[-1]
        if history["order"] == 1:
            x = xc - (1 - s) * phi * (0.5 * (m - ms[-1]))
        else:
            b = torch.stack([g1 / phi, (g1 / -hc - 0.5) * 2 / phi])
            r = (lam(sigmas[i - 2]) - lam(sigmas[i - 1])) / hc
            rho = (
                torch.linalg.solve(torch.tensor([[1.0, 1.0], [float(r), 1.0]]), b)
                if r.isfinite()
                else [0, b[0]]
            )
            x = xc - (1 - s) * phi * (rho[0] * ((ms[-2] - ms[-1]) / r) + rho[1] * (m - ms[-1]))
    phi = torch.expm1(-h)
    x_next = s_next / s * x - (1 - s_next) * phi * m
    if order == 2:  # UniP-2
        x_next = x_next - (1 - s_next) * phi * (0.5 * ((ms[-1] - m) / ((lam(sigmas[i - 1]) - lam(s)) / h)))
    history.update(m=(ms + [m])[-2:], corrected=x, order=order)
    return x_next, order


def split_streams(x, streams) -> dict[str, torch.Tensor]:
    """The rows of a joint latent cut into its latent streams, each [B, *shape], by name (none: {})."""
    parts = torch.split(x, [math.prod(s.shape) for s in streams], dim=1) if streams else []
    return {s.name: p.reshape(len(x), *s.shape) for s, p in zip(streams, parts, strict=True)}


def velocity(model, call, x, timestep: float, env: dict) -> torch.Tensor:
    """One branch's float32 velocity of the rows x by the transformer-call rule (protocol.md 2, 3)."""
    dtype = getattr(torch, call.model_dtype)
    t = torch.full((len(x),), timestep, dtype=torch.float32)
    t = (
        (call.timestep_offset - t) if call.timestep_reversed else (t - call.timestep_offset)
    ) / call.timestep_divisor
    t = t if call.timestep_float32 else t.to(dtype)
    latents, env = x.to(dtype), dict(env)
    if call.conditioning.concat in (pb.CONDITIONING_CONCAT_SEQUENCE, pb.CONDITIONING_CONCAT_CHANNELS):
        latents = torch.cat([latents, env.pop(call.conditioning.env_key).to(dtype)], dim=1)
    times = dict.fromkeys([call.timestep_argument or "timestep", *call.timestep_copies], t)
    argument, batched = call.latents_argument or "hidden_states", set(call.batched_env_keys)
    if call.streams:  # the joint latent cut into the streams, each under its own argument
        parts = split_streams(latents, call.streams).values()
        outputs = model(**{s.argument: p for s, p in zip(call.streams, parts, strict=True)}, **times, **env)
        prediction = torch.cat([out.flatten(1) for out in outputs[: len(call.streams)]], dim=1)
    elif call.inputs == pb.TRANSFORMER_INPUTS_PACKED_SAMPLE:  # a call per row, a timestep per token
        rows = []
        for b in range(len(x)):
            row = {k: v[b] if k in batched else v for k, v in env.items()}
            t_b = t[b].repeat(row[call.timestep_tokens_key].numel())
            rows.append(model(**{argument: [latents[b : b + 1]], call.timestep_argument: t_b}, **row)[0][0])
        prediction = torch.cat(rows)
    elif call.inputs == pb.TRANSFORMER_INPUTS_PER_SAMPLE_FRAMES:  # lists of rows, a frame axis at dim 1
        env = {k: list(v) if k in batched else v for k, v in env.items()}
        output = model(**{argument: list(latents.unsqueeze(2))}, **times, **env)[0]
        prediction = torch.stack(output).squeeze(2)
    else:
        assert call.inputs in (pb.TRANSFORMER_INPUTS_UNSPECIFIED, pb.TRANSFORMER_INPUTS_BATCHED), call.inputs
        prediction = model(**{argument: latents}, **times, **env)[0]
    v = prediction[:, : x.shape[1]].float()
    return -v if call.negated_prediction else v


def guide(rule: str, scale: float, v: dict) -> torch.Tensor:  # protocol.md 2, "Guidance"
    positive, negative = v["positive"], v.get("negative")
    if rule in ("none", "cfg_from_positive"):
        return positive if rule == "none" else positive + scale * (positive - negative)
    assert rule in ("true_cfg", "true_cfg_norm_rescale"), rule
    c = negative + scale * (positive - negative)
    return (
        c if rule == "true_cfg" else c * (positive.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True))
    )


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a transformer's tensors: names, dtypes, shapes and bytes, sorted by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}\t{tensor.dtype}\t{list(tensor.shape)}\n".encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_models(roots: list[Path], document: dict) -> dict[str, torch.nn.Module]:
    """The file's transformers by pipeline component, checked against the digests it records."""
    name = re.compile(rf"{re.escape(document['model'])}(-[0-9a-f]{{12}})?")
    found = [p for root in roots if root.is_dir() for p in root.iterdir() if name.fullmatch(p.name)]
    if not found:
        raise FileNotFoundError(f"no folder of model {document['model']!r} in {list(map(str, roots))}")
    folder, models = max(found, key=lambda path: path.stat().st_mtime), {}
    for component, digest in document["weights_sha256"].items():
        model = diffusers.AutoModel.from_pretrained(str(folder), subfolder=component)
        if weights_digest(model) != digest:
            raise ValueError(f"{folder / component} is not the model the vectors were recorded with")
        models[component] = model.eval()
    return models


def entry(key: str, value, tensors: dict, call, rows: int):
    """An env entry of the case's prompt for its rows: {"tensor": name} is that tensor, batched: repeated."""
    if not (isinstance(value, dict) and set(value) == {"tensor"}):
        return value
    value = tensors[value["tensor"]]
    return torch.cat([value] * rows) if key in call.batched_env_keys else value


def replay_case(case: dict, tensors: dict, models: dict) -> dict:
    """The checks of one case (max_log_prob_error, max_latent_error, noise_bitwise, orders_match), passed."""
    started = json_format.ParseDict(case["started"], pb.RolloutStarted())
    call, rows = started.transformer_call, len(started.seeds)
    sampler = case["request"]["sampler"].removeprefix("SAMPLER_TYPE_")
    sigmas = torch.tensor(list(started.sigmas), dtype=torch.float32)
    known = {int(j): tensors[name] for j, name in case["latents"].items()}
    env = {
        branch: {k: entry(k, v, tensors, call, rows) for k, v in kw["0"].items()}
        for branch, kw in case["env"].items()
    }
    shape, streams = list(started.layout.shape), list(call.streams)
    noise_bitwise = torch.equal(draw(started.seeds, 0, shape, streams), known[0])
    lp_errors, latent_errors, orders, history, x = [0.0], [0.0], [], {"m": []}, known[0]
    for i, stochastic in enumerate(started.stochastic):
        model = models[started.step_transformers[i] if started.step_transformers else "transformer"]
        with torch.no_grad():
            v = {branch: velocity(model, call, x, started.timesteps[i], e) for branch, e in env.items()}
        scale = call.guidance_rule_scales[i] if call.guidance_rule_scales else call.guidance_rule_scale
        v = guide(call.guidance_rule, scale, v)
        if stochastic:
            eps = tensors[case["eps"][str(i)]]
            noise_bitwise &= torch.equal(draw(started.seeds, i + 1, shape, streams), eps)
            mean, sd = transition(sampler, x, v, sigmas, i, started.noise_levels[i])
            residual, constants = known[i + 1] - mean, started.log_prob_constants
            expected = {"": case["log_probs"][i], **(case["stream_log_probs"][i] if streams else {})}
            parts = {"": residual, **split_streams(residual, streams)}  # joint, and each stream's own
            for name, part in parts.items():
                lp_errors.append(
                    float((log_prob(part, sd, constants) - torch.tensor(expected[name])).abs().max())
                )
            x_next, order, history = mean + sd * eps, 1, {"m": []}  # the noise ends the solver's history
        else:
            solver = pb.Solver.Name(started.step_solvers[i]).lower().removeprefix("solver_")
            x_next, order = solve(solver, x, v, sigmas, i, history)
        orders.append(order)
        if i + 1 in known:  # a stored latent: compared, and the next step starts from it
            latent_errors.append(float((x_next - known[i + 1]).abs().max()))
        x = known.get(i + 1, x_next)
    scale = max([call.guidance_rule_scale, *call.guidance_rule_scales], key=abs)
    result = {
        "max_log_prob_error": max(lp_errors),
        "max_latent_error": max(latent_errors),
        "latent_tolerance": latent_tolerance(call.guidance_rule, scale),
        "noise_bitwise": bool(noise_bitwise),
        "orders_match": orders == list(started.step_orders),
    }
    within = result["max_log_prob_error"] <= LOG_PROB_TOLERANCE
    within &= result["max_latent_error"] <= result["latent_tolerance"]
    return result | {"passed": within and result["noise_bitwise"] and result["orders_match"]}


def replay_file(path: Path, roots: list[Path], names=None) -> dict[str, dict]:
    """Each case's checks (``names``: only those cases) of one vector file."""
    with safe_open(path, "pt") as opened:
        document = json.loads(opened.metadata()["conformance"])
    tensors, models = load_file(path), load_models(roots, document)
    cases = [case for case in document["cases"] if names is None or case["name"] in names]
    return {case["name"]: replay_case(case, tensors, models) for case in cases}


def main(argv=None) -> int:
    cache = Path(os.environ.get("ROLLOUT_SERVER_CACHE", Path.home() / ".cache" / "rollout-server")) / "models"
    parser = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="vector files (default: vectors/*.safetensors)")
    parser.add_argument("--models", type=Path, action="append", help=f"the model folders' folder ({cache})")
    args = parser.parse_args(argv)
    failures = 0
    for path in args.files or sorted((Path(__file__).parent / "vectors").glob("*.safetensors")):
        for name, result in replay_file(path, args.models or [cache]).items():
            failures += not result["passed"]
            print("pass" if result["passed"] else "FAIL", path.stem, name, json.dumps(result), flush=True)
    print(f"{failures} cases failed" if failures else "every case passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
