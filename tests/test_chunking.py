"""Every message stays under the server's limit; larger payloads are split and reassembled exactly."""

import pytest
import torch
from support.parity import assert_same_env
from support.requests import make_request, split_events, stream_events
from support.servers import start_server

from rollout.v1 import rollout_pb2, rollout_pb2_grpc
from rollout_client import RolloutClient
from rollout_client.events import decode_stream
from rollout_server.limits import Limits

# The smallest message limit a server allows when requests hold at most 4 samples and trees 16 nodes
# (it must fit a started event echoing 4 prompts of the longest length, and listing the nodes): small
# enough to split this rollout's env and x_0, debug tensors and images.
MAX_SAMPLES, MAX_TREE_NODES = 4, 16
LIMIT = Limits(max_samples=MAX_SAMPLES, max_tree_nodes=MAX_TREE_NODES).min_message_bytes
REQUEST = {
    "prompts": ["a red fox", "a blue bird"],
    "samples_per_prompt": 2,
    "base_seed": 21,
    "height": 256,
    "width": 256,
    "num_steps": 3,
    "true_cfg_scale": 2.0,
    "negative_prompt": "blurry",
    "debug_tensors": [rollout_pb2.DEBUG_TENSOR_EPS, rollout_pb2.DEBUG_TENSOR_MEAN],
}


@pytest.fixture(scope="module")
def small_message_server(tiny_flux_folder, cache_dir, tmp_path_factory):
    process = start_server(
        cache_dir,
        tmp_path_factory.mktemp("logs") / "small.log",
        "--max-message-bytes",
        str(LIMIT),
        "--max-samples",
        str(MAX_SAMPLES),
        "--max-tree-nodes",
        str(MAX_TREE_NODES),
    )
    yield process
    process.stop()


def test_messages_stay_under_the_limit_and_reassemble(small_message_server, client):
    import grpc

    with grpc.insecure_channel(small_message_server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        info = stub.GetServerInfo(rollout_pb2.GetServerInfoRequest())
        assert info.limits.max_message_bytes == LIMIT
        messages = list(stub.Rollout(make_request(REQUEST), timeout=120))
    assert max(m.ByteSize() for m in messages) <= LIMIT
    kinds = [m.WhichOneof("event") for m in messages]
    split = {
        kind for kind, after in zip(kinds, kinds[1:], strict=False) if kind != "chunk" and after == "chunk"
    }
    assert split == {"started", "step", "image"}, (
        "the env and x_0, the step tensors and the images must be split"
    )
    assert kinds.count("started") == 1 and kinds.count("finished") == 1 and kinds[-1] == "finished"

    chunked = split_events(decode_stream(messages))
    whole = stream_events(client, REQUEST)
    assert [type(e) for e in chunked.events] == [type(e) for e in whole.events]
    assert torch.equal(chunked.started.x0, whole.started.x0)
    assert_same_env(chunked.started.env, whole.started.env)
    for a, b in zip(chunked.steps, whole.steps, strict=True):
        assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.debug["eps"], b.debug["eps"])
        torch.testing.assert_close(a.x_next, b.x_next, atol=1e-6, rtol=0)
    for a, b in zip(chunked.images, whole.images, strict=True):
        assert a.sample_index == b.sample_index and a.png[:8] == b"\x89PNG\r\n\x1a\n"
    trajectories = chunked.trajectories()
    assert [t.seed for t in trajectories] == list(chunked.started.message.seeds)


def test_shared_env_tensors_are_sent_once(client):
    """The negative prompt's embedding and the position ids travel once, referenced by the others."""
    started = stream_events(client, REQUEST, images=False).started
    names = [t.name for t in started.message.tensors.manifest]
    assert sum(name.endswith("/img_ids") for name in names) == 1
    assert (
        sum(name.startswith("env/negative/") and name.endswith("encoder_hidden_states") for name in names)
        == 1
    )
    negatives = started.env["negative"]
    assert torch.equal(negatives[0]["encoder_hidden_states"], negatives[1]["encoder_hidden_states"])
    assert not torch.equal(
        started.env["positive"][0]["encoder_hidden_states"],
        started.env["positive"][1]["encoder_hidden_states"],
    )


def test_chunked_stream_collects_into_trajectories(small_message_server):
    """The client library reads a chunked stream to the end, images included."""
    with RolloutClient(small_message_server.address, timeout=120) as small_client:
        trajectories = small_client.rollout(prompts=["a fox"], samples_per_prompt=2, base_seed=1, num_steps=2)
    assert len(trajectories) == 2 and all(t.image() is not None for t in trajectories)
