"""Who may call the server: TLS credentials, bearer tokens and the warning for an exposed bind.

Two optional tokens, read once at start-up. The rollout token allows Rollout, GetServerInfo and
PruneRollout; the admin token allows those and the weight RPCs (UpdateWeights, LoadWeights, the
weight-sync group's InitWeightSync, UpdateWeightsFromGroup and DestroyWeightSync, and ReleaseMemory
and ResumeMemory). With only a
rollout token, that one token allows everything; with only an admin token, rollouts stay open.
Health checking and reflection are always open; each HTTP endpoint needs the token of the gRPC
method it stands for. A missing or unknown token is UNAUTHENTICATED;
the rollout token on a weight RPC is PERMISSION_DENIED.
"""

import hmac
import ipaddress
import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from rollout.v1 import rollout_pb2
from rollout_core.transport import AUTHORIZATION, read_token
from rollout_server.errors import StartupError

log = logging.getLogger("rollout_server.auth")
_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


def method_path(name: str) -> str:
    """The gRPC path of a RolloutService method, as a TokenPolicy checks it."""
    return f"/{_SERVICE}/{name}"


ROLLOUT_METHODS = frozenset(method_path(name) for name in ("Rollout", "GetServerInfo", "PruneRollout"))
WEIGHT_METHODS = frozenset(
    method_path(name)
    for name in (
        "UpdateWeights",
        "LoadWeights",
        "InitWeightSync",
        "UpdateWeightsFromGroup",
        "DestroyWeightSync",
        "ReleaseMemory",
        "ResumeMemory",
    )
)
_BEARER = "bearer "
# The gRPC handler factory for each (request streaming, response streaming) method shape.
HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _read_pem(path: Path, what: str, label: str) -> bytes:
    """The file's bytes, if it holds a PEM block whose label ends with ``label``."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise StartupError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if f"{label}-----".encode() not in data:
        raise StartupError(f"{what} {path} holds no PEM {label}")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """PEM bytes of the server's key and certificate chain, and of the CA that signs the client
    certificates (None: clients are not asked for one); and their files, which the HTTP front end's
    TLS reads."""

    key: bytes
    cert: bytes
    client_ca: bytes | None
    key_path: Path
    cert_path: Path
    client_ca_path: Path | None

    @classmethod
    def load(cls, cert: Path | None, key: Path | None, client_ca: Path | None) -> "ServerTLS | None":
        if cert is None and key is None:
            if client_ca is not None:
                raise StartupError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if cert is None or key is None:
            raise StartupError("--tls-cert and --tls-key go together: give both or neither")
        return cls(
            key=_read_pem(key, "--tls-key", "PRIVATE KEY"),
            cert=_read_pem(cert, "--tls-cert", "CERTIFICATE"),
            client_ca=_read_pem(client_ca, "--tls-client-ca", "CERTIFICATE") if client_ca else None,
            key_path=key,
            cert_path=cert,
            client_ca_path=client_ca,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def load_token(path: Path | None, option: str) -> bytes | None:
    """The token in ``path`` (stripped, non-empty) as bytes; a warning if others may read the file."""
    if path is None:
        return None
    try:
        token = read_token(path)
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise StartupError(f"cannot read {option} {path}: {reason}") from None
    except ValueError as error:
        raise StartupError(f"{option}: {error}") from None
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s is accessible to group or others: chmod 600 it", option, path)
    return token.encode()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure_warning(host: str, has_token: bool) -> str | None:
    """The warning for binding a non-loopback address without any token, or None."""
    if has_token or is_loopback(host):
        return None
    return (
        f"WARNING: listening on {host} without --auth-token-file or --admin-token-file.\n"
        "WARNING: anyone who can reach this port can run rollouts (GPU time) and replace the\n"
        "WARNING: policy weights (UpdateWeights) without any credential. See docs/security.md."
    )


@dataclass(frozen=True)
class TokenPolicy:
    """Which token each method needs; ``check`` is the whole decision."""

    rollout_token: bytes | None = None
    admin_token: bytes | None = None

    @property
    def enabled(self) -> bool:
        return self.rollout_token is not None or self.admin_token is not None

    def check(self, method: str, authorization: str | None) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go on, else (status code, message). The message never holds a token."""
        if method in WEIGHT_METHODS:
            needed = self.admin_token or self.rollout_token  # with a single token, that one
            granted = [needed] if needed else []
            lesser = self.rollout_token if self.admin_token else None  # known, but not enough here
        elif method in ROLLOUT_METHODS and self.rollout_token is not None:
            granted = [token for token in (self.rollout_token, self.admin_token) if token]
            lesser = None
        else:
            return None  # health, reflection, and rollouts when only an admin token exists
        if not granted:
            return None
        presented = _bearer(authorization)
        if presented is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
        # Every comparison runs, each in constant time.
        matches = [hmac.compare_digest(presented, token) for token in granted]
        if any(matches):
            return None
        if lesser is not None and hmac.compare_digest(presented, lesser):
            return grpc.StatusCode.PERMISSION_DENIED, "this token does not allow weight updates"
        return grpc.StatusCode.UNAUTHENTICATED, "invalid token"


def _bearer(authorization: str | None) -> bytes | None:
    if authorization is None or not authorization.lower().startswith(_BEARER):
        return None
    return authorization[len(_BEARER) :].strip().encode()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Applies a TokenPolicy to every call before its handler runs."""

    def __init__(self, policy: TokenPolicy, on_refused: Callable[[grpc.StatusCode], None]):
        self.policy = policy
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        refusal = self.policy.check(handler_call_details.method, metadata.get(AUTHORIZATION))
        handler = await continuation(handler_call_details)
        if refusal is None or handler is None:
            return handler
        code, message = refusal
        log.info("refused %s: %s", handler_call_details.method, code.name)
        self.on_refused(code)
        return _refusing(handler, code, message)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same shape as ``handler`` that ends the call with ``code``."""

    async def refuse(request_or_iterator, context):
        await context.abort(code, message)

    return HANDLER_KINDS[handler.request_streaming, handler.response_streaming](
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
