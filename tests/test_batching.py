"""Continuous batching across requests, on real servers: a rollout streams the same numbers whether
it ran alone or shared its forwards with others (mixed samplers, CFG on and off, sizes, group
sizes), a cancel or a slow client touches no other rollout, and a weight update waits for the
rollouts started before it while later ones start on the new weights."""

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from support.errors import health_status
from support.parity import assert_replays, assert_same_numbers
from support.requests import split_events
from support.servers import start_server
from support.weights import TO_Q

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RolloutClient, Started, Step

FLOW_SDE, DANCE, CPS, ODE = (
    rollout_pb2.SAMPLER_TYPE_FLOW_SDE,
    rollout_pb2.SAMPLER_TYPE_DANCE,
    rollout_pb2.SAMPLER_TYPE_CPS,
    rollout_pb2.SAMPLER_TYPE_ODE,
)
COMMON = {
    "latents": rollout_pb2.LATENT_SELECTION_ALL,
    "debug_tensors": [rollout_pb2.DEBUG_TENSOR_EPS],
    "images": False,
}
# Two sizes, so two compatible groups; each request has a partner of its size. Mixed samplers, noise
# levels, guidance and CFG scales, group sizes, step counts, latent dtypes and tree rollouts.
MIXED = {
    "flow-64": {"prompts": ["a red fox"], "samples_per_prompt": 2, "height": 64, "width": 64, "num_steps": 8},
    "cps-cfg-64": {
        "prompts": ["a lighthouse at dusk"],
        "samples_per_prompt": 3,
        "height": 64,
        "width": 64,
        "num_steps": 9,
        "sampler": CPS,
        "true_cfg_scale": 3.0,
        "negative_prompt": "blurry",
    },
    "ode-64": {
        "prompts": ["two cats"],
        "height": 64,
        "width": 64,
        "num_steps": 7,
        "sampler": ODE,
        "solver": rollout_pb2.SOLVER_DPMPP_2M,
    },
    "unipc-window-64": {
        "prompts": ["a kite"],
        "samples_per_prompt": 2,
        "height": 64,
        "width": 64,
        "num_steps": 6,
        "stochastic_steps": [2, 3],
        "solver": rollout_pb2.SOLVER_UNIPC,
    },
    "tree-64": {
        "prompts": ["a kite"],
        "height": 64,
        "width": 64,
        "num_steps": 8,
        "branches": [rollout_pb2.Branch(step=1, factor=2), rollout_pb2.Branch(step=4, factor=3)],
    },
    "dance-128": {
        "prompts": ["two cats", "a bowl of ramen"],
        "samples_per_prompt": 1,
        "height": 128,
        "width": 128,
        "num_steps": 8,
        "sampler": DANCE,
        "guidance_scale": 2.0,
    },
    "flow-cfg-bf16-128": {
        "prompts": ["a red fox"],
        "samples_per_prompt": 2,
        "height": 128,
        "width": 128,
        "num_steps": 10,
        "noise_level": 0.9,
        "true_cfg_scale": 2.0,
        "negative_prompt": "low quality",
        "latent_dtype": rollout_pb2.TENSOR_DTYPE_BFLOAT16,
    },
}


def mixed_request(name: str, seed: int = 7) -> rollout_pb2.RolloutRequest:
    return rollout_pb2.RolloutRequest(base_seed=seed, **COMMON, **MIXED[name])


@pytest.fixture(scope="module")
def batching_server(tiny_flux_folder, cache_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("batching") / "server.log"
    server = start_server(cache_dir, log_path, "--stall-seconds", "4")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def batching_client(batching_server):
    with RolloutClient(batching_server.address, timeout=300) as rollout_client:
        yield rollout_client


def run_together(client: RolloutClient, server, transformer, requests: dict, read=list) -> dict:
    """``read(stream)`` of each request (default: all its events), all released at the same moment:
    they wait for the next policy version, which an update that leaves the weights as they are
    (``transformer``'s) then brings."""
    version = client.server_info().policy_version + 1
    results: dict = {}

    def run(name) -> None:
        request = rollout_pb2.RolloutRequest(request_id=str(name), min_policy_version=version)
        request.MergeFrom(requests[name])
        results[name] = read(client.stream(request))

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
        f"rollout id={name} waits for policy version {version}" in server.log() for name in requests
    ):
        time.sleep(0.05)
    client.update_weights({TO_Q: transformer.state_dict()[TO_Q].clone()}, version, kind="subset")
    for thread in threads:
        thread.join(timeout=300)
    assert sorted(results) == sorted(requests)
    return results


def test_a_rollout_streams_the_same_alone_and_batched(batching_client, batching_server, tiny_transformer):
    requests = {name: mixed_request(name) for name in MIXED}
    alone = {name: split_events(batching_client.stream(request)) for name, request in requests.items()}
    together = run_together(batching_client, batching_server, tiny_transformer, requests, split_events)
    for name in MIXED:
        assert alone[name].finished.message.shared_steps == 0
        # Every request had a partner of its size in flight: its rows shared forwards.
        assert together[name].finished.message.shared_steps > 0, name
        assert_same_numbers(together[name], alone[name], bitwise_log_probs=False)
        assert_replays(tiny_transformer, together[name].trajectories())  # the trainer's replay


def test_a_cancel_mid_batch_leaves_the_others_running(batching_client, batching_server, tiny_transformer):
    """Three rollouts step together; one caller cancels after two steps. The other two finish, each
    with its solo numbers, and the server keeps serving."""
    long = {"prompts": ["a red fox"], "samples_per_prompt": 2, "height": 64, "width": 64, "num_steps": 30}
    requests = {k: rollout_pb2.RolloutRequest(base_seed=k, **COMMON, **long) for k in (1, 2, 3)}
    alone = {k: split_events(batching_client.stream(request)) for k, request in requests.items() if k != 2}

    def read(stream) -> list:
        events = []
        for event in stream:
            events.append(event)
            if events[0].message.resolved.base_seed == 2 and len(events) == 3:  # started, 2 steps
                stream.close()  # cancels the call
                break
        return events

    results = run_together(batching_client, batching_server, tiny_transformer, requests, read)
    assert [type(e) for e in results[2]] == [Started, Step, Step]
    for k in (1, 3):
        rollout = split_events(results[k])
        assert rollout.finished.message.shared_steps > 0
        assert_same_numbers(rollout, alone[k], bitwise_log_probs=False)
    deadline = time.monotonic() + 30
    while "status=CANCELLED" not in batching_server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "status=CANCELLED" in batching_server.log()
    assert health_status(batching_client.channel) == health_pb2.HealthCheckResponse.SERVING


def test_a_stalled_consumer_holds_nobody_back(batching_client, batching_server):
    """A client that stops reading a payload-heavy stream gets its rollout parked, not the batch:
    another rollout started after it finishes well within the stall limit (4 s here), and the stalled
    call ends with ABORTED once the limit passes."""
    heavy = rollout_pb2.RolloutRequest(
        prompts=["a red fox"],
        samples_per_prompt=4,
        height=512,
        width=512,
        num_steps=40,
        base_seed=5,
        latents=rollout_pb2.LATENT_SELECTION_ALL,
        debug_tensors=[
            rollout_pb2.DEBUG_TENSOR_EPS,
            rollout_pb2.DEBUG_TENSOR_MEAN,
            rollout_pb2.DEBUG_TENSOR_VELOCITY,
        ],
        images=False,
    )
    stub = rollout_pb2_grpc.RolloutServiceStub(batching_client.channel)
    stalled = stub.Rollout(heavy, timeout=120)
    assert next(stalled).HasField("started")  # then read nothing more
    time.sleep(1.0)  # its messages fill the transport's windows, then its outbox: it parks
    began = time.monotonic()
    quick = batching_client.rollout(
        prompts=["two cats"], samples_per_prompt=2, height=64, width=64, num_steps=6, images=False
    )
    assert len(quick) == 2 and time.monotonic() - began < 3.0
    time.sleep(5.0)  # past the stall limit
    with pytest.raises(grpc.RpcError) as ended:
        for _ in stalled:
            pass
    assert ended.value.code() == grpc.StatusCode.ABORTED
    assert "read nothing for 4 s" in ended.value.details()
    assert len(batching_client.rollout(prompts=["a fox"], num_steps=2, height=64, width=64)) == 1


def test_a_weight_update_waits_for_the_rollouts_started_before_it(
    tiny_flux_folder, tiny_transformer, cache_dir, tmp_path
):
    """Two rollouts run (their clients read slowly) when an update arrives; a third is sent after it,
    while they still run. The first two finish on version 0 and replay with the old weights; the
    update is applied only once they are done; the third starts on version 1 and replays with the
    new weights."""
    from diffusers import FluxTransformer2DModel

    new = FluxTransformer2DModel.from_pretrained(tiny_flux_folder / "transformer").eval()
    name = "proj_out.weight"
    with torch.no_grad():
        new.get_parameter(name).mul_(1.5)
    server = start_server(cache_dir, tmp_path / "update.log")
    try:
        with RolloutClient(server.address, timeout=300) as client:
            long = {"prompts": ["a red fox"], "samples_per_prompt": 2, "height": 64, "width": 64}
            before: dict[int, list] = {}
            times: dict[str, float] = {}
            running = threading.Barrier(3)

            def run(seed: int) -> None:
                events = []
                for event in client.stream(base_seed=seed, num_steps=30, images=False, **long):
                    events.append(event)
                    if len(events) == 2:
                        running.wait()
                    time.sleep(0.1)  # a slow reader: the rollout lasts a few seconds
                before[seed] = events
                times[f"finished-{seed}"] = time.monotonic()

            def update() -> None:
                client.update_weights({name: new.get_parameter(name).detach()}, 1, kind="subset")
                times["applied"] = time.monotonic()

            threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
            for thread in threads:
                thread.start()
            running.wait()
            updater = threading.Thread(target=update)
            updater.start()
            deadline = time.monotonic() + 60
            while "weight update to version 1 queued" not in server.log() and time.monotonic() < deadline:
                time.sleep(0.02)
            times["sent"] = time.monotonic()
            after = client.rollout(base_seed=3, num_steps=4, images=False, **long)
            for thread in [*threads, updater]:
                thread.join(timeout=300)
    finally:
        assert server.stop() == 0
    # The third was sent while the first two ran, and after the update had been queued.
    assert times["sent"] < min(times["finished-1"], times["finished-2"], times["applied"])
    # Every step of the first two replays with the old weights: the update did not land mid-rollout.
    for events in before.values():
        assert events[0].message.policy_version == 0
        assert_replays(tiny_transformer, split_events(events).trajectories())
    assert {trajectory.policy_version for trajectory in after} == {1}
    assert_replays(new, after)
