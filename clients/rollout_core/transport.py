"""What both ends of a connection agree on besides the messages: the largest message a client takes,
the metadata names of retries and tokens, and how a token file is read.

Imports the standard library only, so that command lines and the server's limits read it without
loading torch or grpc.
"""

from pathlib import Path

# The largest message a client takes: above any a server sends (its limit is reported by
# GetServerInfo, and a server refuses a limit above this one).
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
# gRPC sends each retry with this header: the number of earlier attempts. A server reports it back in
# the trailer (absent on a first attempt).
PREVIOUS_ATTEMPTS_HEADER = "grpc-previous-rpc-attempts"
PREVIOUS_ATTEMPTS_TRAILER = "rollout-previous-attempts"
# The call metadata that carries a bearer token ("Bearer <token>").
AUTHORIZATION = "authorization"


def read_token(path: str | Path) -> str:
    """A token file's content, surrounding whitespace stripped; ValueError if nothing is left."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token
