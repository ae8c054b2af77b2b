"""How a client proves who it is and checks whom it talks to: TLS files and bearer tokens."""

from dataclasses import dataclass
from pathlib import Path

import grpc

from rollout_core.transport import AUTHORIZATION, read_token

__all__ = ["TLS", "bearer_metadata", "read_token"]  # read_token is the server's too (rollout_core.transport)


@dataclass(frozen=True)
class TLS:
    """TLS to the server. ``ca``: PEM file of the CA that signed the server's certificate (None: the
    system's roots). ``cert`` and ``key``: PEM files of this client's certificate and private key, for
    a server that requires client certificates (mutual TLS)."""

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca), private_key=read(self.key), certificate_chain=read(self.cert)
        )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token`` (none without one)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()
