"""The wire grows without breaking: the schema stays compatible with the released one (`buf breaking`,
as `make lint` runs it), and a client reads a later server's stream, skipping the events and fields it
does not know."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from google.protobuf.unknown_fields import UnknownFieldSet
from support.families import family_request
from support.parity import assert_same_kwargs
from support.requests import make_request
from support.servers import ROOT

from rollout.v1 import rollout_pb2
from rollout_client.client import varint
from rollout_client.events import decode_stream
from rollout_client.trajectory import collect

MAKEFILE = (ROOT / "Makefile").read_text()
# The buf command and the released schema image, as `make lint` names them.
BUF = re.search(r"^BUF := (.+)$", MAKEFILE, re.MULTILINE).group(1).split()
RELEASED_SCHEMA = ROOT / re.search(r"^RELEASED_SCHEMA := (.+)$", MAKEFILE, re.MULTILINE).group(1)
PROTO = Path("protos/rollout/v1/rollout.proto")


def buf_breaking(workspace: Path) -> subprocess.CompletedProcess:
    """`buf breaking` of the buf workspace ``workspace`` against the released schema."""
    if shutil.which(BUF[0]) is None:
        pytest.skip(f"{BUF[0]} is not installed (make lint needs it too)")
    command = [*BUF, "breaking", "--against", str(RELEASED_SCHEMA)]
    return subprocess.run(command, cwd=workspace, capture_output=True, text=True, timeout=300)


def test_the_schema_is_compatible_with_the_released_one():
    result = buf_breaking(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_renumbered_field_breaks_the_released_schema(tmp_path):
    shutil.copy(ROOT / "buf.yaml", tmp_path)
    source = (ROOT / PROTO).read_text()
    renumbered = source.replace("optional uint32 num_steps = 9;", "optional uint32 num_steps = 99;")
    assert renumbered != source
    (tmp_path / PROTO).parent.mkdir(parents=True)
    (tmp_path / PROTO).write_text(renumbered)
    result = buf_breaking(tmp_path)
    assert result.returncode != 0
    assert 'field "9" with name "num_steps" on message "RolloutRequest" was deleted' in result.stdout, (
        result.stdout + result.stderr
    )


# Events of a later server: oneof fields this client does not know. Fields inside known events too.
NEXT_EVENT_FIELD = max(field.number for field in rollout_pb2.RolloutResponse.DESCRIPTOR.fields) + 1
NEXT_FIELD = 1000
LENGTH_DELIMITED = 2
REQUEST = {
    "prompts": ["a red fox", "a lighthouse"],
    "samples_per_prompt": 2,
    "base_seed": 17,
    "height": 64,
    "width": 64,
    "num_steps": 3,
    "true_cfg_scale": 2.0,
    "negative_prompt": "blurry",
}


def length_delimited(field_number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field, encoded by hand."""
    return varint(field_number << 3 | LENGTH_DELIMITED) + varint(len(payload)) + payload


def later_event(request_id: str) -> rollout_pb2.RolloutResponse:
    """A message of an event this client does not know, parsed from the bytes a later server sends."""
    event = rollout_pb2.RolloutStep(index=7, log_probs=[0.5]).SerializeToString()  # any bytes will do
    raw = rollout_pb2.RolloutResponse(request_id=request_id).SerializeToString()
    return rollout_pb2.RolloutResponse.FromString(raw + length_delimited(NEXT_EVENT_FIELD, event))


def with_later_field(response: rollout_pb2.RolloutResponse) -> rollout_pb2.RolloutResponse:
    """``response`` with a field this client does not know appended to its event's bytes."""
    kind = response.WhichOneof("event")
    event = getattr(response, kind).SerializeToString() + length_delimited(NEXT_FIELD, b"later")
    extended = rollout_pb2.RolloutResponse(request_id=response.request_id)
    getattr(extended, kind).ParseFromString(event)
    return extended


def chunk(index: int) -> rollout_pb2.RolloutResponse:
    return rollout_pb2.RolloutResponse(chunk=rollout_pb2.PayloadChunk(index=index, data=b"later payload"))


@pytest.fixture(scope="module")
def wire_bytes(client) -> list[bytes]:
    """A real server's stream, as the wire delivered it."""
    return [
        message.SerializeToString() for message in client.stub.Rollout(make_request(REQUEST), timeout=120)
    ]


@pytest.fixture
def captured(wire_bytes) -> list[rollout_pb2.RolloutResponse]:
    """The stream's messages, parsed afresh: decoding takes the payload bytes out of them."""
    return [rollout_pb2.RolloutResponse.FromString(raw) for raw in wire_bytes]


def assert_same_trajectories(a, b) -> None:
    assert len(a) == len(b)
    for one, two in zip(a, b, strict=True):
        assert (one.seed, one.prompt_index, one.transformer_call) == (
            two.seed,
            two.prompt_index,
            two.transformer_call,
        )
        for name in ("sigmas", "timesteps", "stochastic", "latents", "latent_mask", "log_probs"):
            assert torch.equal(getattr(one, name).nan_to_num(), getattr(two, name).nan_to_num()), name
        assert one.env.keys() == two.env.keys()
        for branch in one.env:
            assert_same_kwargs(one.env[branch], two.env[branch])
        assert one.frames_png == two.frames_png and one.frames_png


def test_unknown_events_and_fields_are_skipped(captured, wire_bytes):
    kinds = [message.WhichOneof("event") for message in captured]
    assert kinds[:2] == ["started", "step"] and kinds[-1] == "finished" and "image" in kinds
    rid = captured[0].request_id
    later = later_event(rid)
    assert later.WhichOneof("event") is None and later.request_id == rid
    # The unknown event's bytes are kept as unknown fields: the message serialises back to them.
    assert [field.field_number for field in UnknownFieldSet(later)] == [NEXT_EVENT_FIELD]
    started, first_step = with_later_field(captured[0]), with_later_field(captured[1])
    assert [field.field_number for field in UnknownFieldSet(started.started)] == [NEXT_FIELD]
    grown = [
        started,
        later,  # an unknown event between two known ones
        first_step,
        *captured[2:-1],
        later,  # one with a payload: its chunks are skipped with it
        chunk(1),
        chunk(2),
        with_later_field(captured[-1]),
        later,  # one at the end
    ]
    again = [rollout_pb2.RolloutResponse.FromString(raw) for raw in wire_bytes]
    assert_same_trajectories(collect(decode_stream(grown)), collect(decode_stream(again)))


def test_protocol_errors_still_raise(captured):
    # A chunk that follows a known event's whole payload.
    with pytest.raises(ValueError, match="outside a payload"):
        list(decode_stream([captured[0], chunk(1), *captured[1:]]))
    with pytest.raises(ValueError, match="outside a payload"):
        list(decode_stream([captured[0], later_event(""), chunk(1), captured[1], chunk(1)]))
    # A payload cut short.
    cut = rollout_pb2.RolloutResponse()
    cut.CopyFrom(captured[0])
    cut.started.tensors.following_chunks = 2
    with pytest.raises(ValueError, match="expected payload chunk 1"):
        list(decode_stream([cut, *captured[1:]]))


# The schema as it was before several latent streams: what a client pinned to it reads (without the
# previews too, which came later and carry RolloutAudio).
STREAM_FIELDS = {"TransformerCall": {"streams", "timestep_copies"}, "RolloutStep": {"stream_log_probs"}}
STREAM_EVENTS = {"audio", "preview"}
STREAM_MESSAGES = {"LatentStream", "StreamLogProbs", "RolloutAudio", "RolloutPreview"}


def schema_before_streams() -> type:
    """RolloutResponse of the rollout.v1 schema without the latent-stream fields, events and messages."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto()
    rollout_pb2.DESCRIPTOR.CopyToProto(file)
    kept = [message for message in file.message_type if message.name not in STREAM_MESSAGES]
    del file.message_type[:]
    file.message_type.extend(kept)
    for message in file.message_type:
        dropped = STREAM_FIELDS.get(message.name, set()) | (
            STREAM_EVENTS if message.name == "RolloutResponse" else set()
        )
        fields = [field for field in message.field if field.name not in dropped]
        del message.field[:]
        message.field.extend(fields)
    pool = descriptor_pool.DescriptorPool()
    for dependency in rollout_pb2.DESCRIPTOR.dependencies:
        dependency_file = descriptor_pb2.FileDescriptorProto()
        dependency.CopyToProto(dependency_file)
        pool.Add(dependency_file)
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("rollout.v1.RolloutResponse"))


def unknown_fields(message, path: str = "") -> list[str]:
    """Where ``message`` and the messages in it hold fields their schema does not know."""
    found = [f"{path}{message.DESCRIPTOR.name}.{field.field_number}" for field in UnknownFieldSet(message)]
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        for item in value if field.is_repeated else [value]:
            found += unknown_fields(item, f"{path}{field.name}.")
    return found


def test_a_client_from_before_latent_streams_reads_a_one_stream_video_as_before(family_resources):
    """A Wan stream (video, one latent tensor) holds nothing the schema before streams lacks: an old
    client parses every message whole, as it did. An LTX-2 stream (video and audio) holds the new
    fields and events, which that client keeps as unknown fields and skips."""
    old_response = schema_before_streams()
    assert "audio" not in old_response.DESCRIPTOR.fields_by_name
    for family, one_stream in [("wan", True), ("ltx2", False)]:
        request = family_request(family, "FLOW_SDE", cfg=True, images=True, samples_per_prompt=1)
        messages = list(family_resources.client(family).stub.Rollout(request, timeout=120))
        unknown = [
            place
            for message in messages
            for place in unknown_fields(old_response.FromString(message.SerializeToString()))
        ]
        if one_stream:
            assert unknown == []
            continue
        assert any(place.endswith("RolloutResponse.8") for place in unknown)  # the audio events
        assert any(place.endswith("TransformerCall.17") for place in unknown)  # the streams
        assert any(place.endswith("RolloutStep.10") for place in unknown)  # the per-stream log-probs
