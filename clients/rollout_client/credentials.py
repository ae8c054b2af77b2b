"""How a client proves who it is and checks whom it talks to: TLS files and bearer tokens."""

from dataclasses import dataclass
from pathlib import Path

import grpc

AUTHORIZATION = "authorization"


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


def read_token(path: str | Path) -> str:
    """A token file's content, surrounding whitespace stripped; ValueError if nothing is left."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``token`` (none without one)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()
