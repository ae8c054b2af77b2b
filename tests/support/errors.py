"""gRPC errors as a client sees them (status codes, rich field violations, health) and grpcurl."""

import json
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from rollout.v1 import rollout_pb2

SERVICE = "rollout.v1.RolloutService"
GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).with_name("grpcurl"))


def health_status(channel: grpc.Channel) -> int | grpc.StatusCode:
    """The overall health status, or the error code when the check itself fails."""
    try:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as error:
        return error.code()
    return response.status


def field_violations(error: grpc.RpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The google.rpc.BadRequest field violations in an error's rich status details."""
    status = rpc_status.from_call(error)
    violations = []
    for detail in status.details if status else ():
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            violations.extend(bad_request.field_violations)
    return violations


def refused_rollout(
    client, request: rollout_pb2.RolloutRequest
) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """The field violations of a rollout the server refuses with INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as refused:
        client.rollout(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return field_violations(refused.value)


def grpcurl(
    address: str, *args: str, flags: Iterable[str] = ("-plaintext",), data: dict | None = None
) -> subprocess.CompletedProcess:
    """Run grpcurl (plaintext unless ``flags`` say otherwise) and capture its output."""
    data_flags = ["-d", json.dumps(data)] if data is not None else []
    return subprocess.run(
        [GRPCURL, *flags, *data_flags, address, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def grpcurl_exit(code: grpc.StatusCode) -> int:
    """grpcurl exits with 64 + the gRPC status code on an RPC error."""
    return 64 + code.value[0]
