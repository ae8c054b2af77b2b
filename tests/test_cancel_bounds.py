"""A cancel frees the worker within one piece of work, not a whole round or decode: on a real tiny-wan
server, a rollout at the server's latent bound cancelled during its round (8 samples, so 8 forwards:
a forward carries at most one row at the bound), or a rollout cancelled during its 41-frame decode,
leaves the worker to the next request after about one forward or one latent frame's decode. Each
bound is checked as a ratio to the same work uncancelled, measured in the same test (the machine's
speed cancels out). The server's bound is set to the test rollout's latent: at the default bound
one row's forward takes about 90 s on one CPU thread."""

import time

import grpc
import pytest
from support.requests import make_request
from support.servers import start_server

from rollout.v1 import rollout_pb2, rollout_pb2_grpc

BASE = {
    "prompts": ["a red fox"],
    "num_steps": 1,
    "sampler": rollout_pb2.SAMPLER_TYPE_ODE,
    "latents": rollout_pb2.LATENT_SELECTION_NONE,
    "images": False,
}
# 8 samples at the server's latent bound: one round of 8 forwards of one row, about 0.3 s each.
FORWARDS = {**BASE, "samples_per_prompt": 8, "height": 192, "width": 192, "num_frames": 41}
LATENT_BOUND = 16 * 11 * 24 * 24  # 16 channels, (41 - 1) / 4 + 1 latent frames of 192 / 8 squared
# One sample's 41 frames, decoded one latent frame (4 frames) at a time: 11 pieces.
DECODE = {**BASE, "samples_per_prompt": 1, "height": 96, "width": 96, "num_frames": 41, "images": True}
SMALL = {**BASE, "samples_per_prompt": 1, "height": 64, "width": 64, "num_frames": 5}
# The worker must be free after this share of the uncancelled work: one piece is 1/8 of the round
# and about 1/10 of the decode (measured: 0.03 to 0.08 of it; without pieces 0.56 to 1.05), so a
# quarter leaves room for a noisy machine.
FREED_WITHIN = 0.25


@pytest.fixture(scope="module")
def stub(family_resources, cache_dir, tmp_path_factory):
    family_resources.folder("wan")  # the preset, built once for the session
    log = tmp_path_factory.mktemp("cancel") / "server.log"
    server = start_server(cache_dir, log, "--model", "tiny-wan", "--max-latent-elements", str(LATENT_BOUND))
    with grpc.insecure_channel(server.address) as channel:
        yield rollout_pb2_grpc.RolloutServiceStub(channel)
    server.stop()


def finished(stub, fields: dict) -> rollout_pb2.RolloutFinished:
    messages = list(stub.Rollout(make_request(fields), timeout=300))
    return messages[-1].finished


def small_seconds(stub) -> float:
    """How long the small rollout takes on an idle server, call included."""
    began = time.monotonic()
    finished(stub, SMALL)
    return time.monotonic() - began


def seconds_to_free_after_cancel(stub, fields: dict, cancel_after: str) -> float:
    """Start ``fields``, cancel it once its ``cancel_after`` event arrives, and return how long a
    small rollout sent right then waits for the worker: its time to finish, less its time alone.
    (With its own time left in, a server on 2 threads, whose forwards are shorter beside the small
    rollout's fixed cost, came out above the bound while freeing the worker after one forward.)"""
    alone = small_seconds(stub)
    call = stub.Rollout(make_request(fields), timeout=300)
    while next(call).WhichOneof("event") != cancel_after:
        pass
    call.cancel()
    cancelled_at = time.monotonic()
    finished(stub, SMALL)
    return time.monotonic() - cancelled_at - alone


def test_a_cancel_waits_for_one_forward_not_the_round(stub):
    finished(stub, SMALL)  # warm
    round_seconds = finished(stub, FORWARDS).denoise_seconds
    waited = seconds_to_free_after_cancel(stub, FORWARDS, cancel_after="started")
    assert waited <= FREED_WITHIN * round_seconds, (waited, round_seconds)


def test_a_cancel_waits_for_one_decode_piece_not_the_video(stub):
    decode_seconds = finished(stub, DECODE).decode_seconds
    waited = seconds_to_free_after_cancel(stub, DECODE, cancel_after="step")
    assert waited <= FREED_WITHIN * decode_seconds, (waited, decode_seconds)
