"""The conformance kit (conformance/README.md): the reference replayer passes the committed vectors and
fails when one formula or one field of a vector is perturbed, the vectors recorded again here are the
committed ones, and `rollout-client conformance` passes against every family's server and fails a
stream that breaks a rule.

The suite replays one case per family (SUITE_CASES: each family's call rule, and among them every
sampler, both CFG modes and every solver window) and every case of tiny-flux through the CLI; the
whole kit, every case of every family, runs with `python conformance/replay.py` (README.md).
"""

import copy
import json
import math
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.families import FAMILIES
from support.parity import TOLERANCE
from support.servers import ROOT

from rollout.v1 import rollout_pb2
from rollout_client import conformance
from rollout_client.cli import main
from rollout_client.events import Step

KIT = ROOT / "conformance"
sys.path.insert(0, str(KIT))  # the kit's scripts import each other as scripts do
import generate  # noqa: E402
import replay  # noqa: E402

# The family (tests/support/families.py FAMILIES) of each tiny preset.
FAMILY_OF = {spec.preset: name for name, spec in FAMILIES.items() if spec.preset.startswith("tiny-")}
# Its processor needs torchvision, which the machine that recorded the vectors lacks.
WITHOUT_VECTORS = {"tiny-qwen-image-edit"}
# One case per family, the suite's share of the kit: CFG on where the family has it (both branches and
# its guidance rule), the sampler and the solver window taking turns, so that every sampler, solver and
# window is replayed on some family. HunyuanVideo 1.5's forwards, the slowest (2000 text tokens), take
# its three-step case without CFG; the full run replays the rest.
SUITE_CASES = {
    "tiny-flux": "FLOW_SDE/cfg/sde 2 in unipc",
    "tiny-flux-kontext": "CPS/cfg/sde all",
    "tiny-flux2": "DANCE/no-cfg/sde 2 in dpmpp_2m",
    "tiny-flux2-klein": "ODE/cfg/dpmpp_2m",
    "tiny-sd3": "DANCE/cfg/sde 2 in euler",
    "tiny-qwen-image": "FLOW_SDE/cfg/sde all",
    "tiny-wan": "CPS/cfg/sde 2 in unipc",
    "tiny-wan2.2": "FLOW_SDE/cfg/sde 2 in dpmpp_2m",
    "tiny-wan-i2v": "ODE/cfg/unipc",
    "tiny-hunyuan-video15": "FLOW_SDE/no-cfg/sde all",
    "tiny-ltx2": "DANCE/cfg/sde all",
    "tiny-cosmos3": "CPS/cfg/sde 2 in dpmpp_2m",
    "tiny-z-image": "FLOW_SDE/cfg/sde 2 in euler",
}
# The case the perturbations break: a FLOW_SDE step between dpmpp_2m's, with CFG.
PERTURBED = "FLOW_SDE/cfg/sde 2 in dpmpp_2m"


def vector_file(preset: str):
    path = KIT / "vectors" / f"{preset}.safetensors"
    with safe_open(path, "pt") as opened:
        return json.loads(opened.metadata()["conformance"]), load_file(path)


def test_there_are_vectors_of_every_case_of_every_tiny_preset():
    """A file per tiny preset, holding today's cases: those of a server with every sampler and solver,
    with CFG but on FLUX.2 [dev], which has none."""
    presets = FAMILY_OF.keys() - WITHOUT_VECTORS
    assert {path.stem for path in (KIT / "vectors").glob("*.safetensors")} == presets == SUITE_CASES.keys()
    for preset in SUITE_CASES:
        info = rollout_pb2.GetServerInfoResponse(
            sampler_types=list(rollout_pb2.SamplerType.values())[1:],
            solvers=list(rollout_pb2.Solver.values())[1:],
            cfg_scale_field="guidance_scale",
            cfg_rule="none" if preset == "tiny-flux2" else "true_cfg",
        )
        expected = [case.name for case in conformance.cases(info)]
        assert [case["name"] for case in vector_file(preset)[0]["cases"]] == expected
        assert SUITE_CASES[preset] in expected


@pytest.mark.parametrize("preset", sorted(SUITE_CASES))
def test_the_reference_replayer_passes_the_vectors(preset, family_resources):
    folder = family_resources.folder(FAMILY_OF[preset])  # the preset, built in the session's cache
    path = KIT / "vectors" / f"{preset}.safetensors"
    results = replay.replay_file(path, [folder.parent], [SUITE_CASES[preset]])
    assert list(results) == [SUITE_CASES[preset]]
    assert all(result["passed"] for result in results.values()), results


@pytest.fixture(scope="module")
def flux_vectors(tiny_flux_folder):
    """The perturbed case, which passes as it is."""
    document, tensors = vector_file("tiny-flux")
    models = replay.load_models([tiny_flux_folder.parent], document)
    case = next(case for case in document["cases"] if case["name"] == PERTURBED)
    assert replay.replay_case(case, tensors, models)["passed"]
    return case, tensors, models


def flipped_sde_mean(x, v, s, s_next, std_t):
    """FLOW_SDE's mean with the sign of its velocity term flipped."""
    dt = s_next - s
    return x * (1 + std_t**2 / (2 * s) * dt) - v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt


def perturb(name: str, case: dict, monkeypatch) -> dict:
    """``case`` with one formula of the replayer or one field of the vector perturbed."""
    started, call = case["started"], case["started"]["transformer_call"]
    if name == "flow_sde_mean_sign":
        monkeypatch.setattr(replay, "sde_mean", flipped_sde_mean)
    elif name == "log_prob_constant":  # log(2 pi) for log(sqrt(2 pi))
        monkeypatch.setattr(replay, "LOG_SQRT_2PI", math.log(2 * math.pi))
    elif name == "solver_order":  # dpmpp_2m never at second order
        monkeypatch.setattr(replay, "solver_order", lambda solver, i, steps, known: 1)
    elif name == "seed":
        started["seeds"][1] = str(int(started["seeds"][1]) + 1)
    elif name == "sigma":  # the stochastic step's sigma, by one part in a thousand
        started["sigmas"][2] *= 1.001
    elif name == "guidance_scale":
        call["guidance_rule_scale"] += 0.5
    return case


# Each perturbation and the check it must fail.
PERTURBATIONS = {
    "flow_sde_mean_sign": "max_log_prob_error",
    "log_prob_constant": "max_log_prob_error",
    "solver_order": "max_latent_error",
    "seed": "noise_bitwise",
    "sigma": "max_log_prob_error",
    "guidance_scale": "max_latent_error",
}


@pytest.mark.parametrize("perturbation", PERTURBATIONS)
def test_the_replayer_fails_a_perturbed_formula_or_field(perturbation, flux_vectors, monkeypatch):
    case, tensors, models = flux_vectors
    result = replay.replay_case(perturb(perturbation, copy.deepcopy(case), monkeypatch), tensors, models)
    assert not result["passed"], result
    failed = PERTURBATIONS[perturbation]
    if failed == "noise_bitwise":
        assert not result["noise_bitwise"]
    else:  # well beyond the bound, not a rounding's worth
        bound = replay.LOG_PROB_TOLERANCE if failed == "max_log_prob_error" else result["latent_tolerance"]
        assert result[failed] > 10 * bound, result


def test_vectors_recorded_again_are_the_committed_ones(client):
    """Two tiny-flux cases recorded again from the suite's server: bitwise where the recording machine
    runs this (conformance/generate.py records the same bytes twice), and on any machine:
    * the started event's numbers: seeds are integers, and the schedule the scheduler's float64
      arithmetic rounded to float32, where a last-bit difference of a library's exp would have to land
      on a float32 tie to show;
    * x_0 and eps bitwise (docs/testing.md, "Noise");
    * the log-probs, computed from eps and sd alone ("Log-probs from eps"): another CPU's reduction may
      sum the N = 64 terms of a sample's mean in another order, an error of about log2(N) u mean|term|
      = 6 x 6e-8 x 3 (a term is -eps^2 / 2 - log sd - 0.92 with sd about 0.3), 1e-6: within TOLERANCE;
    * the latents, which chain the model's velocities: within TOLERANCE ("Batch and split rounding")
      x (2s - 1) under CFG at scale s."""
    names = ["CPS/no-cfg/sde all", PERTURBED]
    store, document = generate.record_model(client, names)
    committed, committed_tensors = vector_file("tiny-flux")
    assert document["weights_sha256"] == committed["weights_sha256"]  # else: the preset changed, record again
    cases = {case["name"]: case for case in committed["cases"]}
    for case in document["cases"]:
        expected = cases[case["name"]]
        assert case["started"] == expected["started"] and case["request"] == expected["request"]
        for i, name in case["eps"].items():
            assert torch.equal(store[name], committed_tensors[expected["eps"][i]])
        assert torch.equal(store[case["latents"]["0"]], committed_tensors[expected["latents"]["0"]])
        for mine, theirs in zip(case["log_probs"], expected["log_probs"], strict=True):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), atol=TOLERANCE, rtol=0)
        call = expected["started"]["transformer_call"]
        bound = replay.latent_tolerance(call["guidance_rule"], call["guidance_rule_scale"])
        for j, name in case["latents"].items():
            difference = (store[name] - committed_tensors[expected["latents"][j]]).abs().max()
            assert difference <= bound, (case["name"], j, float(difference))


def conformance_rows(capsys, *argv: str) -> tuple[int, list[str]]:
    """The exit status of `rollout-client conformance ARGV` and the rows of its table."""
    code = main(["conformance", *argv])
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["sampler", "cfg", "window"]
    return code, rows


@pytest.mark.parametrize("preset", sorted(SUITE_CASES))
def test_rollout_client_conformance_passes_on_every_family(preset, family_resources, capsys):
    """Every case on tiny-flux; the replayed case on the other families (their rollouts, of every
    case, would take minutes: HunyuanVideo 1.5's alone 25 s)."""
    address = family_resources.server(FAMILY_OF[preset]).address
    cases = [] if preset == "tiny-flux" else ["--case", SUITE_CASES[preset]]
    code, rows = conformance_rows(capsys, address, "--timeout", "300", *cases)
    assert len(rows) == (30 if preset == "tiny-flux" else 1)
    assert code == 0 and all(row.endswith("pass") for row in rows), "\n".join(rows)


def test_rollout_client_conformance_replays_through_the_model(server, tiny_flux_folder, capsys):
    code, rows = conformance_rows(
        capsys,
        server.address,
        "--model",
        str(tiny_flux_folder),
        "--case",
        "*/cfg/sde 2 in *",
        "--timeout",
        "300",
    )
    assert len(rows) == 9 and code == 0 and all(row.endswith("pass") for row in rows), "\n".join(rows)


def test_rollout_client_conformance_refuses_a_model_other_than_the_served_one(
    server, family_resources, capsys
):
    folder = family_resources.folder("flux2-klein")
    assert main(["conformance", server.address, "--model", str(folder), "--case", "ODE/no-cfg/euler"]) == 1
    assert "are not the policy the server serves" in capsys.readouterr().err


@pytest.fixture(scope="module")
def flux_stream(client):
    """A case's stream, which passes as it is."""
    case = conformance.Case("FLOW_SDE", True, "unipc", window=True)
    events = list(client.stream(conformance.request(client.server_info(), case)))
    assert conformance.check(case, events).passed
    return case, events


def tampered(events: list, field: str) -> list:
    """The stream with one streamed number of its stochastic step changed."""
    events = copy.deepcopy(events)
    step = next(e for e in events if isinstance(e, Step) and e.stochastic)
    if field == "eps":
        step.debug["eps"][0, 0] += 1e-3
    elif field == "log_prob":
        step.log_probs[0] += 1e-3
    else:  # x_{i+1}, which the log-prob and the next steps read
        step.x_next[0] += 1e-3
    return events


@pytest.mark.parametrize("field", ["eps", "log_prob", "x_next"])
def test_the_conformance_check_fails_a_stream_that_breaks_a_rule(field, flux_stream):
    case, events = flux_stream
    result = conformance.check(case, tampered(events, field))
    assert not result.passed
    assert conformance.table([result]).splitlines()[1].endswith("FAIL")
