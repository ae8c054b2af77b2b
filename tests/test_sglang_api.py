"""SGLang-Diffusion's rollout API on a real server (``serve --http-port``), checked with SGLang's own
request model (``io_struct.RolloutRequest``) and tensor codec (``utils._maybe_deserialize``), taken
from its released package: the wheel is downloaded from the package index once per run and the two
files are loaded by path (importing the package would pull its GPU stack; nothing of it is in the
repo). Every stochastic step of every sample replays from the decoded ``dit_trajectory`` and
``denoising_env`` through the bare diffusers transformer; HTTP and gRPC give the same rollout bit for
bit; hostile bodies get their 4xx and leave the server serving. TLS and tokens over HTTP are in
test_security.py."""

import json
import re
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType, SimpleNamespace

import grpc
import httpx
import msgpack
import pytest
import torch
from grpc_health.v1 import health_pb2
from support.errors import health_status
from support.families import FAMILIES
from support.parity import TOLERANCE
from support.reference import bare_velocity, guidance, log_prob, mean_and_sd
from support.servers import command_line_exit, http_url, metrics_url, scrape
from support.sglang import sglang_source

from rollout.v1 import rollout_pb2
from rollout_core.transformer_call import TransformerCall

_POST_TRAINING = "sglang/multimodal_gen/runtime/entrypoints/post_training"
SGLANG_FILES = {"io_struct": f"{_POST_TRAINING}/io_struct.py", "utils": f"{_POST_TRAINING}/utils.py"}
SAMPLES = 4
STEPS = 4
SEED = 1234
# A partial window: steps 1 and 2 stochastic, the latents around them returned (x_1, x_2, x_3).
SDE_STEPS = [2, 1]  # any order, as SGLang takes them
RETURNED = [1, 2, 3]
SIZE = {"flux": {}, "wan": {"num_frames": 5}, "ltx2": {"num_frames": 9}}
CFG = {
    "flux": {"true_cfg_scale": 3.0, "negative_prompt": "blurry, low quality"},
    "wan": {"guidance_scale": 5.0, "negative_prompt": "blurry"},
    "ltx2": {"guidance_scale": 3.0, "negative_prompt": "silence"},
}
NO_CFG = {"flux": {}, "wan": {"guidance_scale": 1.0}, "ltx2": {"guidance_scale": 1.0}}


@pytest.fixture(scope="session")
def sglang(cache_dir):
    """SGLang's RolloutRequest model and its tensor decoder, from the released wheel."""
    modules = {}
    for name, member in SGLANG_FILES.items():
        # Registered before it runs: its dataclasses look their module up.
        module = modules[name] = sys.modules[f"sglang_{name}"] = ModuleType(f"sglang_{name}")
        module.__file__ = member
        exec(compile(sglang_source(cache_dir, member), member, "exec"), module.__dict__)
    return SimpleNamespace(
        RolloutRequest=modules["io_struct"].RolloutRequest, deserialize=modules["utils"]._maybe_deserialize
    )


def post(url: str, path: str, body=None, content=None, headers=None, timeout=300) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, content=content, headers=headers, timeout=timeout)


def generate(sglang, url: str, request) -> list[dict]:
    """POST an SGLang RolloutRequest as its own client does (model_dump as JSON): the decoded answers."""
    answer = post(url, "/rollout/generate", request.model_dump())
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/msgpack"
    return [sglang.deserialize(item) for item in msgpack.unpackb(answer.content)]


def conformance_request(sglang, family: str, sde_type: str, cfg: bool, **fields):
    """Four samples of one prompt, steps 1 and 2 of 4 stochastic, the latents around them returned,
    with the denoising env; ``fields`` override."""
    values = {
        "prompt": FAMILIES[family].prompts[0],
        "seed": SEED,
        "width": 64,
        "height": 64,
        "num_inference_steps": STEPS,
        "num_outputs_per_prompt": SAMPLES,
        "rollout_sde_type": sde_type,
        "rollout_noise_level": 0.7,
        "rollout_sde_step_indices": SDE_STEPS,
        "rollout_return_step_indices": RETURNED,
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
        "rollout_debug_mode": False,
        **SIZE[family],
        **(CFG if cfg else NO_CFG)[family],
    }
    return sglang.RolloutRequest(**{**values, **fields})


def replayed_log_prob(transformer, answer: dict, i: int, sampler: str, constants: bool) -> float:
    """Step i of one answer replayed from its dit_trajectory and denoising_env alone: a bare forward
    per CFG branch (of the expert that ran the step, when ``transformer`` holds several by name), the
    branches combined at the step's scale, and the float64 step formulas (tests/reference.py)."""
    trajectory, env = answer["dit_trajectory"], answer["denoising_env"]
    call = TransformerCall.from_json(json.dumps(env["transformer_call"]))
    if isinstance(transformer, dict):
        transformer = transformer[env["step_transformers"][i]]
    at = trajectory["step_indices"].index
    x = trajectory["latents"][at(i)].unsqueeze(0)
    t, offset = torch.full((1,), trajectory["timesteps"][at(i)].item()), call.form.timestep_offset
    timestep = ((offset - t) if call.form.timestep_reversed else (t - offset)) / call.timestep_divisor
    # The diffusers call's kwargs: without the keys SGLang's pipeline configs add beside them.
    branches = {"positive": env["pos_cond_kwargs"]}
    if env["neg_cond_kwargs"] is not None:
        branches["negative"] = env["neg_cond_kwargs"]
    branches = {
        name: {key: value for key, value in kwargs.items() if key not in env["sglang_keys"]}
        for name, kwargs in branches.items()
    }
    with torch.no_grad():
        v = {
            name: bare_velocity(
                transformer,
                x,
                timestep,
                {**kwargs, **(env["image_kwargs"] or {})},
                call,
            )
            for name, kwargs in branches.items()
        }
    velocity = guidance(call.guidance_rule, call.guidance_scale_at(i), v)
    sigmas = trajectory["sigmas"].double().numpy()
    mean, sd = mean_and_sd(sampler, x.double().numpy(), velocity, sigmas, i, 0.7)
    x_next = trajectory["latents"][at(i + 1)].unsqueeze(0).double().numpy()
    return float(log_prob(x_next, mean, sd, constants)[0])


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("family", ["flux", "wan", "ltx2"])  # LTX-2: joint video + audio latents
def test_sglang_requests_replay_from_the_bare_transformer(sglang, family_resources, family, sde_type, cfg):
    """Built with SGLang's model and decoded with its codec: four distinct samples with their own
    seeds, each stochastic step's log-prob replayed within TOLERANCE, the deterministic ones 0."""
    url = http_url(family_resources.server(family))
    answers = generate(sglang, url, conformance_request(sglang, family, sde_type, cfg))
    assert [a["seed"] for a in answers] == [SEED + k for k in range(SAMPLES)]
    assert len({a["request_id"] for a in answers}) == 1
    log_probs = torch.stack([a["rollout_log_probs"] for a in answers])
    assert log_probs.shape == (SAMPLES, STEPS)
    assert torch.all(log_probs[:, [0, 3]] == 0)  # deterministic steps, as SGLang reports them
    # Every sample its own noise and log-probs: no group collapse onto the first sample.
    assert len({tuple(row.tolist()) for row in log_probs}) == SAMPLES
    latents = [a["dit_trajectory"]["latents"] for a in answers]
    assert all(not torch.equal(latents[0][-1], other[-1]) for other in latents[1:])
    sampler = {"sde": "FLOW_SDE", "cps": "CPS"}[sde_type]
    transformer = family_resources.transformer(family)
    for answer in answers:
        trajectory = answer["dit_trajectory"]
        assert trajectory["step_indices"] == RETURNED
        assert trajectory["latents"].shape == (len(RETURNED), *FAMILIES[family].latent_shape)
        assert trajectory["sigmas"].shape == (STEPS + 1,) and trajectory["sigmas"][-1] == 0
        assert (answer["denoising_env"]["neg_cond_kwargs"] is not None) == cfg
        assert answer["generated_output"].shape[0] == 3
        for i in sorted(SDE_STEPS):
            replayed = replayed_log_prob(transformer, answer, i, sampler, constants=True)
            assert abs(replayed - answer["rollout_log_probs"][i].item()) <= TOLERANCE


def test_http_and_grpc_give_the_same_rollout_bitwise(sglang, family_resources):
    """The same prompt and seeds over both front ends of one server: equal latents, log-probs,
    schedule and env, bit for bit (the noise is the seed's; batching never changes a row's numbers
    here: each rollout runs alone, in the same batch shape; each front end translates the engine's
    own tensors, the HTTP one without the gRPC stream's encoding)."""
    server = family_resources.server("flux")
    request = conformance_request(sglang, "flux", "sde", cfg=True, rollout_return_step_indices=None)
    answers = generate(sglang, http_url(server), request)
    trajectories = family_resources.client("flux").rollout(
        prompts=[request.prompt],
        samples_per_prompt=SAMPLES,
        seeds=[SEED + k for k in range(SAMPLES)],
        height=64,
        width=64,
        num_steps=STEPS,
        sampler=rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
        noise_level=0.7,
        stochastic_steps=sorted(SDE_STEPS),
        **CFG["flux"],
    )
    for answer, trajectory in zip(answers, trajectories, strict=True):
        assert answer["seed"] == trajectory.seed
        assert answer["dit_trajectory"]["step_indices"] == list(range(STEPS + 1))
        assert torch.equal(answer["dit_trajectory"]["latents"], trajectory.latents)
        assert torch.equal(answer["dit_trajectory"]["sigmas"], trajectory.sigmas)
        assert torch.equal(answer["dit_trajectory"]["timesteps"], trajectory.timesteps)
        stochastic = trajectory.stochastic
        assert torch.equal(answer["rollout_log_probs"][stochastic], trajectory.log_probs[stochastic])
        # The env each branch's forward took: the same tensors, whichever wire carried them.
        env = answer["denoising_env"]
        for branch, kwargs in (("positive", env["pos_cond_kwargs"]), ("negative", env["neg_cond_kwargs"])):
            streamed = trajectory.env[branch]
            for key, value in kwargs.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, streamed[key]), (branch, key)


def test_a_msgpack_body_gets_the_answer_of_its_json_twin(sglang, family_resources):
    url = http_url(family_resources.server("flux"))
    request = conformance_request(sglang, "flux", "cps", cfg=False, rollout_log_prob_no_const=True)
    body = msgpack.packb(request.model_dump())
    answer = post(url, "/rollout/generate", content=body, headers={"content-type": "application/msgpack"})
    assert answer.status_code == 200, answer.text
    from_msgpack = [sglang.deserialize(item) for item in msgpack.unpackb(answer.content)]
    from_json = generate(sglang, url, request)
    for a, b in zip(from_msgpack, from_json, strict=True):
        assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
        assert torch.equal(a["dit_trajectory"]["latents"], b["dit_trajectory"]["latents"])
    # Without constants: SGLang's -(x' - mean)^2, replayed as such.
    transformer = family_resources.transformer("flux")
    replayed = replayed_log_prob(transformer, from_json[0], 1, "CPS", constants=False)
    assert abs(replayed - from_json[0]["rollout_log_probs"][1].item()) <= TOLERANCE


def test_debug_tensors_and_an_evaluation_request(sglang, family_resources):
    """rollout_debug_mode gives SGLang's four per-step tensors (the step's mean is x_{i+1} - sd eps);
    rollout=False is a plain generation: an image and no trajectory."""
    url = http_url(family_resources.server("flux"))
    request = conformance_request(
        sglang, "flux", "sde", cfg=False, rollout_debug_mode=True, rollout_return_step_indices=None
    )
    (answer, *_) = generate(sglang, url, request)
    debug = answer["rollout_debug_tensors"]
    latents = answer["dit_trajectory"]["latents"]
    assert debug["rollout_noise_std_devs"].shape == (STEPS,)
    for i in range(STEPS):
        sd = debug["rollout_noise_std_devs"][i]
        assert (sd > 0) == (i in SDE_STEPS)
        rebuilt = debug["rollout_prev_sample_means"][i] + sd * debug["rollout_variance_noises"][i]
        # x' = mean + sd eps is one fp32 multiply-add on values below 10: a few ulps (< 1e-5) apart.
        torch.testing.assert_close(rebuilt, latents[i + 1], rtol=0, atol=1e-5)
    (plain, *_) = generate(
        sglang, url, sglang.RolloutRequest(prompt="two cats", seed=5, width=64, height=64, rollout=False)
    )
    assert plain["rollout_log_probs"] is None and plain["dit_trajectory"] is None
    assert plain["generated_output"].shape == (3, 64, 64)
    assert plain["generated_output"].min() >= 0 and plain["generated_output"].max() <= 1


HOSTILE = [
    ({"prompt": 7}, ["prompt"]),
    (
        {"prompt": "a", "seed": "7", "num_inference_steps": 2.5, "rollout": "yes"},
        ["seed", "num_inference_steps", "rollout"],
    ),
    ({"prompt": "a", "rollout_sde_type": "flow"}, ["rollout_sde_type"]),
    ({"prompt": "a", "rollout_sde_type": "ode"}, ["rollout_log_prob_no_const"]),
    ({"prompt": "a", "num_inference_steps": 10**6}, ["num_inference_steps"]),
    (
        {"prompt": "a", "num_inference_steps": 4, "rollout_sde_step_indices": [4]},
        ["rollout_sde_step_indices"],
    ),
    (
        {
            "prompt": "a",
            "num_inference_steps": 4,
            "rollout_return_dit_trajectory": True,
            "rollout_return_step_indices": [5],
        },
        ["rollout_return_step_indices"],
    ),
    ({"prompt": "a", "seed": 2**64 - 1, "num_outputs_per_prompt": 2}, ["seed"]),
    ({"prompt": "a", "num_outputs_per_prompt": 10**9}, ["num_outputs_per_prompt"]),
    ({"prompt": "a", "image_path": ["/etc/passwd"]}, ["image_path"]),
    ({"prompt": "a", "extra_sampling_params": {"__class__": 1}}, ["extra_sampling_params.__class__"]),
    # SamplingParams options that would change what is computed, and are not served, by name.
    (
        {"prompt": "a", "extra_sampling_params": {"enable_teacache": True, "flow_shift": 3.0}},
        ["extra_sampling_params.enable_teacache", "extra_sampling_params.flow_shift"],
    ),
    # A seed list has one seed per output, each a uint64.
    (
        {"prompt": "a", "num_outputs_per_prompt": 2, "extra_sampling_params": {"seed": [1]}},
        ["extra_sampling_params.seed"],
    ),
    ({"prompt": "a", "extra_sampling_params": {"seed": [-1]}}, ["extra_sampling_params.seed"]),
    ({"prompt": "a", "rollout_noise_level": float("nan")}, ["rollout_noise_level"]),
    # Integers take the range of the proto field they become (uint32 here): none reaches it unchecked.
    ({"prompt": "a", "height": 2**40, "width": -1}, ["height", "width"]),
    ({"prompt": "a", "num_inference_steps": 2**32, "num_frames": -1}, ["num_inference_steps", "num_frames"]),
    (
        {"prompt": "a", "rollout_sde_step_indices": [1, 2**40], "rollout_return_step_indices": [-1]},
        ["rollout_sde_step_indices", "rollout_return_step_indices"],
    ),
    ({"prompt": "a", "guidance_scale": 10**400}, ["guidance_scale"]),  # an integer no float holds
    ({"prompt": "a", "fps": 10**6}, ["fps"]),
    # JSON's \ud800 escapes decode to lone surrogates, which no protobuf or answer can carry.
    ({"prompt": "a\ud800", "negative_prompt": "\udfff"}, ["prompt", "negative_prompt"]),
    # The whole answer (every sample's image, trajectory and debug tensors) is bounded before any work.
    (
        {
            "prompt": "a",
            "width": 2048,
            "height": 2048,
            "num_outputs_per_prompt": 64,
            "rollout_debug_mode": True,
            "rollout_return_dit_trajectory": True,
        },
        ["num_outputs_per_prompt"],
    ),
]


def assert_serving(server, url: str) -> None:
    """Both front ends still answer: HTTP /health, and gRPC health SERVING."""
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    with grpc.insecure_channel(server.address) as channel:
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(("body", "fields"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_a_bad_request_is_a_400_naming_its_fields(family_resources, body, fields):
    """... in the answer, and in one log line (no traceback)."""
    server = family_resources.server("flux")
    url = http_url(server)
    logged = server.log()
    raw = json.dumps(body, allow_nan=True)  # NaN as JSON's NaN extension, as Python writes it
    answer = post(url, "/rollout/generate", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    named = {violation["field"] for violation in answer.json()["violations"]}
    assert set(fields) <= named, answer.json()
    new_lines = server.log()[len(logged) :].splitlines()
    assert len(new_lines) == 1 and "rejected" in new_lines[0], new_lines
    assert_serving(server, url)


def test_a_seed_with_a_huge_sample_count_is_refused_before_its_seeds_are_made(family_resources):
    """A seed and ten million samples: refused (400, num_outputs_per_prompt) from the server's
    --max-samples, before a seed per sample is made, so /health is answered within a second
    throughout (making them took the event loop for seconds)."""
    url = http_url(family_resources.server("flux"))
    body = {"prompt": "a", "seed": 1, "num_outputs_per_prompt": 10**7}
    answers = []
    hostile = threading.Thread(target=lambda: answers.append(post(url, "/rollout/generate", body)))
    hostile.start()
    while hostile.is_alive():
        probed_at = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        assert time.perf_counter() - probed_at < 1.0  # the bound: health within a second
    hostile.join()
    assert answers[0].status_code == 400
    assert answers[0].json()["violations"][0]["field"] == "num_outputs_per_prompt"


def raw_post(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send one hand-made request (headers ``head``, then ``body``) and read the answer to its end."""
    host, port = re.match(r"http://(.+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(
            b"POST /rollout/generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head + b"\r\n" + body
        )
        return b"".join(iter(lambda: connection.recv(65536), b""))


def test_bodies_that_are_not_requests(family_resources):
    """A body larger than the receive limit is refused from its length alone (413), before it is
    sent; JSON and msgpack that do not parse, nest too deep or are not an object are 400s."""
    server = family_resources.server("flux")
    url = http_url(server)
    answer = raw_post(url, b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n")
    assert answer.startswith(b"HTTP/1.1 413 ") and b"limit" in answer
    for content, kind in (
        (b"[" * 100_000, "json"),
        (b"\x91" * 100_000, "msgpack"),
        (b"\xc1", "msgpack"),
        (b"{", "json"),
    ):
        answer = post(
            url, "/rollout/generate", content=content, headers={"content-type": f"application/{kind}"}
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["violations"][0]["field"] == "request"
    answer = post(url, "/rollout/generate", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "object" in answer.json()["detail"]
    assert_serving(server, url)


def steps_taken(server) -> float:
    return scrape(metrics_url(server)).get(("rollout_server_steps_total", ()), 0.0)


def test_a_client_that_disconnects_cancels_its_rollout(family_resources):
    """A client that goes away while its 100-step rollout steps stops it: the rollout's log line says
    CANCELLED, the server's step count stops short of 100 more, and the next request is served."""
    server = family_resources.server("flux")
    url = http_url(server)
    host, port = re.match(r"http://(.+):(\d+)", url).groups()
    body = json.dumps(
        {"prompt": "a long one", "num_outputs_per_prompt": 8, "num_inference_steps": 100}
    ).encode()
    before = steps_taken(server)
    with socket.create_connection((host, int(port))) as connection:
        head = f"POST /rollout/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        connection.sendall(head.encode() + body)
        deadline = time.monotonic() + 60
        while steps_taken(server) < before + 2:  # it steps
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 60
    while not re.search(r"samples=8 steps=100 seconds=\S+ status=CANCELLED", server.log()):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)
    assert steps_taken(server) < before + 100
    assert_serving(server, url)


def test_abort_request_stops_a_rollout_by_its_rid_and_frees_its_place(family_resources):
    """A trainer that oversamples stops its tail: /abort_request with the ``rid`` its /rollout/generate
    body carried ends that rollout within a small part of its own uninterrupted run (the abort waits
    for one forward at most), the call answers SGLang's aborted response (its LLM runtime's finish
    reason, no output), and its queue place is free when the answer arrives. ``abort_all`` stops every
    one; an unknown rid none."""
    server = family_resources.server("flux")
    url = http_url(server)
    body = {"prompt": "a long tail", "seed": 9, "num_outputs_per_prompt": 4, "num_inference_steps": 100}
    started = time.perf_counter()
    assert post(url, "/rollout/generate", {**body, "rid": "tail-0"}).status_code == 200
    whole = time.perf_counter() - started

    def aborted(rid: str, abort: dict) -> tuple[httpx.Response, httpx.Response, float]:
        before = steps_taken(server)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(post, url, "/rollout/generate", {**body, "rid": rid})
            deadline = time.monotonic() + 60
            while steps_taken(server) < before + 2:  # it steps
                assert time.monotonic() < deadline
                time.sleep(0.01)
            asked = time.perf_counter()
            answer = post(url, "/abort_request", abort)
            return answer, running.result(timeout=60), time.perf_counter() - asked

    answer, stopped, took = aborted("tail-1", {"rid": "tail-1"})
    assert (answer.status_code, answer.json()) == (200, {"aborted": 1})
    assert took < whole / 4, (took, whole)
    assert stopped.status_code == 200 and stopped.headers["content-type"] == "application/msgpack"
    samples = msgpack.unpackb(stopped.content)
    assert [(s["request_id"], s["seed"], s["generated_output"], s["rollout_log_probs"]) for s in samples] == [
        ("tail-1", 9 + k, None, None) for k in range(4)
    ]
    assert all(s["finish_reason"]["type"] == "abort" for s in samples)
    assert scrape(metrics_url(server))[("rollout_server_in_flight_rollouts", ())] == 0
    assert re.search(r"rollout id=tail-1 samples=4 steps=100 seconds=\S+ status=ABORTED", server.log())

    answer, stopped, _ = aborted("tail-2", {"abort_all": True})
    assert answer.json() == {"aborted": 1} and msgpack.unpackb(stopped.content)[0]["request_id"] == "tail-2"
    assert post(url, "/abort_request", {"rid": "tail-2"}).json() == {"aborted": 0}  # it has ended
    assert post(url, "/abort_request", {}).json() == {"aborted": 0}  # SGLang ignores a body without rid
    for path, bad in (("/abort_request", {"rid": 7}), ("/rollout/generate", {**body, "rid": "x" * 129})):
        refused = post(url, path, bad)
        assert refused.status_code == 400 and refused.json()["violations"][0]["field"] == "rid"
    assert_serving(server, url)


def test_a_client_that_half_closes_after_its_body_gets_its_answer(family_resources):
    """shutdown(SHUT_WR) after the body ends what the client sends, not its call: the rollout runs to
    its end and the whole answer comes back, after the interim 100 Continue with which the server
    probes a half-closed connection (HTTP/1.1 clients skip it)."""
    server = family_resources.server("flux")
    host, port = re.match(r"http://(.+):(\d+)", http_url(server)).groups()
    body = json.dumps(
        {"prompt": "a half-closed fox", "seed": 3, "width": 64, "height": 64, "num_inference_steps": 4}
    ).encode()
    with socket.create_connection((host, int(port)), timeout=120) as connection:
        head = f"POST /rollout/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        connection.sendall(head.encode() + body)
        connection.shutdown(socket.SHUT_WR)
        answer = b"".join(iter(lambda: connection.recv(65536), b""))
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    while answer.startswith(interim):
        answer = answer[len(interim) :]
    status, _, content = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 "), status
    (decoded,) = msgpack.unpackb(content)
    assert (decoded["prompt"], decoded["seed"]) == ("a half-closed fox", 3)
    assert re.search(rf"rollout id={decoded['request_id']} .* status=OK", server.log())


def test_health_generate_runs_the_model(family_resources):
    server = family_resources.server("flux")
    url = http_url(server)
    assert httpx.get(f"{url}/health_generate", timeout=120).status_code == 200
    assert "status=OK" in server.log()


def test_the_http_port_is_checked_before_the_model_loads():
    message = command_line_exit("serve", "--http-port", "70000")
    assert message == "rollout-server: --http-port must be in [0, 65535]"
    message = command_line_exit("serve", "--http-read-seconds", "0")
    assert message == "rollout-server: --http-read-seconds must be above 0"
