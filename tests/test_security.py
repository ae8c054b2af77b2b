"""TLS, mutual TLS and bearer tokens on real servers, through RolloutClient and real grpcurl.

A throwaway CA, server certificate (SAN 127.0.0.1 and localhost) and client certificate are made at
run time; nothing secret is stored in the repository.
"""

import base64
import datetime
import ipaddress
import json
import logging
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2
from safetensors.torch import save, save_file
from support.errors import SERVICE, grpcurl, grpcurl_exit, health_status
from support.servers import command_line_exit, http_url, start_server
from support.weights import TO_Q

from rollout_client import TLS, RolloutClient, RolloutPool
from rollout_client import cli as client_cli
from rollout_server import cli
from rollout_server.auth import TokenPolicy, exposure_warning, load_token

ROLLOUT_TOKEN = "rollout-token-7f3a"
ADMIN_TOKEN = "admin-token-c41d"
REQUEST = {"prompts": ["a red fox"], "samples_per_prompt": 1, "height": 64, "width": 64, "num_steps": 2}


@dataclass(frozen=True)
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _issue(subject: str, key, issuer: x509.Name, signing_key, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollout test CA")])
    ca = _issue(
        "rollout test CA", ca_key, ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=0), True)]
    )
    leaf = x509.BasicConstraints(ca=False, path_length=None), True
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    names = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    server = _issue(
        "localhost",
        server_key,
        ca.subject,
        ca_key,
        [leaf, (names, False), (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)],
    )
    client = _issue(
        "trainer",
        client_key,
        ca.subject,
        ca_key,
        [leaf, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    return PKI(
        ca=_write_cert(folder / "ca.pem", ca),
        server_cert=_write_cert(folder / "server.pem", server),
        server_key=_write_key(folder / "server.key", server_key),
        client_cert=_write_cert(folder / "client.pem", client),
        client_key=_write_key(folder / "client.key", client_key),
    )


def token_file(folder: Path, name: str, token: str) -> Path:
    path = folder / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def tls_server(pki, tiny_flux_folder, cache_dir, tmp_path_factory):
    """TLS only: no client certificates, no tokens."""
    log = tmp_path_factory.mktemp("logs") / "tls.log"
    server = start_server(
        cache_dir, log, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def secured_server(pki, tiny_flux_folder, cache_dir, tmp_path_factory):
    """Mutual TLS and both tokens: the shared-cluster set-up of docs/security.md; the HTTP front end
    too, and LoadWeights from its own folder."""
    folder = tmp_path_factory.mktemp("secured")
    server = start_server(
        cache_dir,
        folder / "secured.log",
        *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)),
        *("--tls-client-ca", str(pki.ca)),
        *("--auth-token-file", str(token_file(folder, "rollout-token", ROLLOUT_TOKEN))),
        *("--admin-token-file", str(token_file(folder, "admin-token", ADMIN_TOKEN))),
        *("--http-port", "0", "--weights-root", str(folder)),
    )
    yield server
    assert server.stop() == 0
    assert ROLLOUT_TOKEN not in server.log() and ADMIN_TOKEN not in server.log()


def mtls(pki: PKI) -> TLS:
    return TLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)


def rpc_code(call) -> grpc.StatusCode | None:
    """The status code ``call()`` fails with, or None when it succeeds."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return None


def grpcurl_tls(pki: PKI, token: str | None = None, client_cert: bool = True) -> list[str]:
    flags = ["-cacert", str(pki.ca)]
    if client_cert:
        flags += ["-cert", str(pki.client_cert), "-key", str(pki.client_key)]
    if token is not None:
        flags += ["-H", f"authorization: Bearer {token}"]
    return flags


def test_tls_refuses_plaintext_and_accepts_the_ca(tls_server, pki):
    """A plaintext client cannot talk to a TLS server; one that trusts the CA can."""
    with RolloutClient(tls_server.address, timeout=30) as plaintext:
        assert rpc_code(plaintext.server_info) == grpc.StatusCode.UNAVAILABLE
    with RolloutClient(tls_server.address, timeout=30, tls=TLS(ca=pki.ca)) as client:
        assert client.server_info().family == "flux"

    assert grpcurl(tls_server.address, f"{SERVICE}/GetServerInfo", flags=["-plaintext"]).returncode != 0
    result = grpcurl(tls_server.address, f"{SERVICE}/GetServerInfo", flags=["-cacert", str(pki.ca)])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["family"] == "flux"


def test_mutual_tls_requires_a_client_certificate(secured_server, pki):
    """With --tls-client-ca, a client without a certificate is refused at the handshake."""
    with RolloutClient(secured_server.address, timeout=30, tls=TLS(ca=pki.ca), token=ROLLOUT_TOKEN) as client:
        assert rpc_code(client.server_info) == grpc.StatusCode.UNAVAILABLE
    with RolloutClient(secured_server.address, timeout=30, tls=mtls(pki), token=ROLLOUT_TOKEN) as client:
        assert client.server_info().family == "flux"

    info = f"{SERVICE}/GetServerInfo"
    no_cert_flags = ["-connect-timeout", "3", *grpcurl_tls(pki, ROLLOUT_TOKEN, client_cert=False)]
    no_cert = grpcurl(secured_server.address, info, flags=no_cert_flags)
    assert no_cert.returncode != 0
    with_cert = grpcurl(secured_server.address, info, flags=grpcurl_tls(pki, ROLLOUT_TOKEN))
    assert with_cert.returncode == 0, with_cert.stderr


def test_tokens_through_the_python_client(secured_server, pki, tiny_transformer):
    """No or a wrong token: UNAUTHENTICATED; the rollout token runs rollouts but may not push
    weights (PERMISSION_DENIED); the admin token does both; health needs no token."""
    subset = {TO_Q: tiny_transformer.state_dict()[TO_Q].clone()}

    def client(token: str | None) -> RolloutClient:
        return RolloutClient(secured_server.address, timeout=120, tls=mtls(pki), token=token)

    with client(None) as anonymous, client("not-the-token") as wrong:
        for caller in (anonymous, wrong):
            assert rpc_code(caller.server_info) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc_code(lambda c=caller: c.rollout(**REQUEST)) == grpc.StatusCode.UNAUTHENTICATED
            update = lambda c=caller: c.update_weights(subset, 1, kind="subset")  # noqa: E731
            assert rpc_code(update) == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(anonymous.channel) == health_pb2.HealthCheckResponse.SERVING

    with client(ROLLOUT_TOKEN) as trainer:
        version = trainer.server_info().policy_version + 1
        assert len(trainer.rollout(**REQUEST)) == 1
        update = lambda: trainer.update_weights(subset, version, kind="subset")  # noqa: E731
        assert rpc_code(update) == grpc.StatusCode.PERMISSION_DENIED
        assert rpc_code(lambda: trainer.load_weights("w.safetensors", version)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )

    with client(ADMIN_TOKEN) as admin:
        assert admin.update_weights(subset, version, kind="subset").policy_version == version
        started = next(iter(admin.stream(**REQUEST)))
        assert started.message.policy_version == version


def test_a_pool_carries_tls_and_tokens_to_its_replicas(secured_server, pki, tiny_transformer):
    """The pool's credentials reach every call, its health checks included; refused ones fail at
    once instead of being retried."""
    for token in (None, "not-the-token"):
        with pytest.raises(grpc.RpcError) as refused:
            RolloutPool([secured_server.address], timeout=120, tls=mtls(pki), token=token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    two_prompts = {**REQUEST, "prompts": ["a red fox", "a kite"]}
    subset = {TO_Q: tiny_transformer.state_dict()[TO_Q].clone()}
    with RolloutPool([secured_server.address], timeout=120, tls=mtls(pki), token=ROLLOUT_TOKEN) as trainer:
        assert [t.prompt_index for t in trainer.rollout(**two_prompts)] == [0, 1]
        version = trainer.version + 1
        assert rpc_code(lambda: trainer.update_weights(subset, version, kind="subset")) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert trainer.retries == 0 and trainer.version == version - 1
        assert trainer.replicas[0].healthy  # a refused update is not a failed replica
    with RolloutPool([secured_server.address], timeout=120, tls=mtls(pki), token=ADMIN_TOKEN) as admin:
        assert admin.update_weights(subset, version, kind="subset").policy_version == version
        time.sleep(1.5)  # a health round of the watcher, over mutual TLS
        assert admin.replicas[0].healthy
        assert {t.policy_version for t in admin.rollout(**two_prompts)} == {version}


def test_tokens_through_grpcurl(secured_server, pki):
    """The same rules through grpcurl's -H: its exit code is 64 + the status code."""
    address = secured_server.address

    def call(token: str | None, method: str, data: dict | None = None) -> int:
        return grpcurl(address, method, flags=grpcurl_tls(pki, token), data=data).returncode

    health = grpcurl(address, "grpc.health.v1.Health/Check", flags=grpcurl_tls(pki))
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}
    assert grpcurl(address, "list", flags=grpcurl_tls(pki)).returncode == 0  # reflection is open

    info, load = f"{SERVICE}/GetServerInfo", f"{SERVICE}/LoadWeights"
    unauthenticated = grpcurl_exit(grpc.StatusCode.UNAUTHENTICATED)
    assert call(None, info) == unauthenticated
    assert call("not-the-token", info) == unauthenticated
    assert call(ROLLOUT_TOKEN, info) == 0
    assert call(ADMIN_TOKEN, info) == 0
    rollout = {**REQUEST, "manifest_only": True, "images": False}
    assert call(ROLLOUT_TOKEN, f"{SERVICE}/Rollout", rollout) == 0
    assert call(None, f"{SERVICE}/Rollout", rollout) == unauthenticated
    weights = {"policy_version": 1000, "path": "w.safetensors"}
    assert call(ROLLOUT_TOKEN, load, weights) == grpcurl_exit(grpc.StatusCode.PERMISSION_DENIED)
    # Past the token check: its --weights-root holds no such file.
    assert call(ADMIN_TOKEN, load, weights) == grpcurl_exit(grpc.StatusCode.NOT_FOUND)


def test_rollout_client_cli_flags(secured_server, pki, tmp_path, capsys):
    """rollout-client info over mutual TLS with --token-file; without the token, UNAUTHENTICATED."""
    flags = ["--address", secured_server.address, "--tls-ca", str(pki.ca)]
    flags += ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    token = ["--token-file", str(token_file(tmp_path, "token", ROLLOUT_TOKEN))]
    assert client_cli.main(["info", *flags, *token]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "flux"
    assert client_cli.main(["info", *flags]) == client_cli.EXIT_RPC_ERROR
    assert capsys.readouterr().err.startswith("rollout-client: UNAUTHENTICATED")
    assert (
        client_cli.main(["info", *flags, "--token-file", str(tmp_path / "missing")]) == client_cli.EXIT_USAGE
    )


ROLLOUT, INFO = f"/{SERVICE}/Rollout", f"/{SERVICE}/GetServerInfo"
PRUNE = f"/{SERVICE}/PruneRollout"
UPDATE, LOAD = f"/{SERVICE}/UpdateWeights", f"/{SERVICE}/LoadWeights"
HEALTH = "/grpc.health.v1.Health/Check"
RELEASE, RESUME = f"/{SERVICE}/ReleaseMemory", f"/{SERVICE}/ResumeMemory"
OK, DENIED, UNAUTHENTICATED = None, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("tokens", "method", "presented", "expected"),
    [
        # Both tokens.
        ({"rollout_token": b"r", "admin_token": b"a"}, ROLLOUT, "r", OK),
        ({"rollout_token": b"r", "admin_token": b"a"}, INFO, "a", OK),
        ({"rollout_token": b"r", "admin_token": b"a"}, UPDATE, "r", DENIED),
        ({"rollout_token": b"r", "admin_token": b"a"}, LOAD, "a", OK),
        ({"rollout_token": b"r", "admin_token": b"a"}, UPDATE, "x", UNAUTHENTICATED),
        ({"rollout_token": b"r", "admin_token": b"a"}, ROLLOUT, None, UNAUTHENTICATED),
        ({"rollout_token": b"r", "admin_token": b"a"}, HEALTH, None, OK),
        ({"rollout_token": b"r", "admin_token": b"a"}, PRUNE, "r", OK),
        ({"rollout_token": b"r", "admin_token": b"a"}, PRUNE, None, UNAUTHENTICATED),
        ({"rollout_token": b"r", "admin_token": b"a"}, RELEASE, "r", DENIED),
        ({"rollout_token": b"r", "admin_token": b"a"}, RESUME, "a", OK),
        # Only a rollout token: it allows everything.
        ({"rollout_token": b"r"}, UPDATE, "r", OK),
        ({"rollout_token": b"r"}, LOAD, None, UNAUTHENTICATED),
        # Only an admin token: rollouts stay open, weights need it.
        ({"admin_token": b"a"}, ROLLOUT, None, OK),
        ({"admin_token": b"a"}, INFO, "anything", OK),
        ({"admin_token": b"a"}, PRUNE, None, OK),
        ({"admin_token": b"a"}, UPDATE, None, UNAUTHENTICATED),
        ({"admin_token": b"a"}, LOAD, "a", OK),
        # No token: everything open.
        ({}, UPDATE, None, OK),
    ],
)
def test_token_policy(tokens, method, presented, expected):
    """Which token each method needs, for each combination of token files."""
    refusal = TokenPolicy(**tokens).check(method, None if presented is None else f"Bearer {presented}")
    assert (refusal and refusal[0]) == expected


def test_token_policy_needs_the_bearer_scheme():
    policy = TokenPolicy(rollout_token=b"r")
    assert policy.check(ROLLOUT, "bearer r") is None
    assert policy.check(ROLLOUT, "r")[0] == UNAUTHENTICATED
    assert policy.check(ROLLOUT, "Basic r")[0] == UNAUTHENTICATED


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "10.1.2.3", "rollouts.example"])
def test_exposed_bind_without_token_warns(host):
    warning = exposure_warning(host, has_token=False)
    assert warning is not None and host in warning
    assert len(warning.splitlines()) >= 3 and all(line.startswith("WARNING") for line in warning.splitlines())
    assert "run rollouts" in warning and "policy" in warning
    assert exposure_warning(host, has_token=True) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_bind_does_not_warn(host):
    assert exposure_warning(host, has_token=False) is None


def test_readable_token_file_warns_without_the_token(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("  s3cret-value \n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="rollout_server.auth"):
        assert load_token(path, "--auth-token-file") == b"s3cret-value"
    assert "chmod 600" in caplog.text and "s3cret" not in caplog.text
    caplog.clear()
    path.chmod(0o600)
    load_token(path, "--auth-token-file")
    assert caplog.text == ""


@pytest.fixture
def files(tmp_path, pki) -> dict[str, str]:
    (tmp_path / "empty").write_text(" \n")
    return {
        "missing": str(tmp_path / "missing.pem"),
        "empty": str(tmp_path / "empty"),
        "ca": str(pki.ca),
        "key": str(pki.client_key),
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-key", "{ca}"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "{ca}"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", "{ca}", "--tls-key", "{missing}"], "cannot read --tls-key"),
        (["--tls-cert", "{empty}", "--tls-key", "{ca}"], "holds no PEM PRIVATE KEY"),
        (["--tls-cert", "{empty}", "--tls-key", "{key}"], "--tls-cert {empty} holds no PEM CERTIFICATE"),
        (
            ["--tls-cert", "{ca}", "--tls-key", "{key}", "--tls-client-ca", "{missing}"],
            "cannot read --tls-client-ca",
        ),
        (["--auth-token-file", "{missing}"], "cannot read --auth-token-file"),
        (["--admin-token-file", "{empty}"], "--admin-token-file: token file"),
    ],
)
def test_security_startup_errors(files, args, message):
    """Unusable security options stop the server before it loads the model, with one line."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", *(arg.format(**files) for arg in args)])
    text = str(stopped.value.code)
    assert text.startswith("rollout-server: ") and message.format(**files) in text and "\n" not in text


def test_key_of_another_certificate_is_a_startup_error(pki, tiny_flux_folder, cache_dir, tmp_path):
    """Caught where gRPC builds the TLS context, after the model loads: still one line, no traceback."""
    message = command_line_exit(
        "serve",
        "--cache-dir",
        str(cache_dir),
        "--port",
        "0",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.client_key),
    )
    assert message.startswith("rollout-server: cannot serve TLS on 127.0.0.1:0") and "\n" not in message
    assert "rollout-worker" not in {thread.name for thread in threading.enumerate()}  # the engine closed


def test_startup_error_is_one_line_without_traceback(files):
    result = subprocess.run(
        [sys.executable, "-m", "rollout_server", "serve", "--tls-key", files["ca"]],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[transformers]")]
    assert lines == ["rollout-server: --tls-cert and --tls-key go together: give both or neither"]


def test_the_http_api_takes_the_same_tls_and_tokens(secured_server, pki, tiny_transformer):
    """The HTTP front end of the secured server: the client certificate is required, health is open,
    rollouts need a token, weights from disk or as tensors the admin token; an update changes the
    checksum /get_weights_checksum reports (that of GetServerInfo), and the base weights bring it
    back."""
    url = http_url(secured_server)
    assert url.startswith("https://")
    folder = secured_server.log_path.parent
    base = {name: tensor.contiguous() for name, tensor in tiny_transformer.state_dict().items()}
    save_file(base, folder / "base.safetensors")
    save_file({**base, TO_Q: base[TO_Q] + 1}, folder / "changed.safetensors")
    context = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
        httpx.get(f"{url}/health", verify=context, timeout=30)
    context.load_cert_chain(pki.client_cert, pki.client_key)

    def call(path: str, token: str | None, body: dict | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        if body is None:
            return httpx.get(f"{url}{path}", headers=headers, verify=context, timeout=120)
        return httpx.post(f"{url}{path}", json=body, headers=headers, verify=context, timeout=120)

    rollout = {"prompt": "a red fox", "width": 64, "height": 64, "num_inference_steps": 2}
    assert call("/health", None).status_code == 200
    for token in (None, "not-the-token"):
        refused = call("/rollout/generate", token, rollout)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert call("/rollout/generate", ROLLOUT_TOKEN, rollout).status_code == 200
    assert (
        call("/update_weights_from_disk", ROLLOUT_TOKEN, {"model_path": "changed.safetensors"}).status_code
        == 403
    )
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/abort_request"):
        assert call(path, ROLLOUT_TOKEN, {}).status_code == 403  # the admin token's, as the weights'

    with RolloutClient(secured_server.address, timeout=120, tls=mtls(pki), token=ADMIN_TOKEN) as admin:
        before = admin.server_info()
        assert call("/get_weights_checksum", ROLLOUT_TOKEN, {}).json() == {
            "transformer": before.weights_checksum
        }
        changed = call("/update_weights_from_disk", ADMIN_TOKEN, {"model_path": "changed.safetensors"})
        assert changed.status_code == 200 and changed.json()["success"] is True, changed.text
        assert changed.json()["policy_version"] == before.policy_version + 1
        assert changed.json()["weights_checksum"] != before.weights_checksum
        after = admin.server_info()
        assert (after.policy_version, after.weights_checksum) == (
            before.policy_version + 1,
            changed.json()["weights_checksum"],
        )
        checksums = call(
            "/get_weights_checksum", ADMIN_TOKEN, {"module_names": ["transformer", "vae"]}
        ).json()
        assert checksums == {"transformer": after.weights_checksum, "vae": "not_found"}
        restored = call("/update_weights_from_disk", ADMIN_TOKEN, {"model_path": "base.safetensors"})
        assert restored.json()["weights_checksum"] == before.weights_checksum
        outside = call("/update_weights_from_disk", ADMIN_TOKEN, {"model_path": "/etc/passwd"})
        assert outside.status_code == 403 and outside.json()["success"] is False  # outside the root
        assert admin.server_info().weights_checksum == before.weights_checksum
    # The same change as tensors: UpdateWeights's token too.
    tensors = {"serialized_named_tensors": [base64.b64encode(save({TO_Q: base[TO_Q] + 1})).decode()]}
    assert call("/update_weights_from_tensor", ROLLOUT_TOKEN, tensors).status_code == 403
    pushed = call("/update_weights_from_tensor", ADMIN_TOKEN, tensors)
    assert (
        pushed.status_code == 200 and pushed.json()["weights_checksum"] == changed.json()["weights_checksum"]
    )
    restored = call("/update_weights_from_disk", ADMIN_TOKEN, {"model_path": "base.safetensors"})
    assert restored.json()["weights_checksum"] == before.weights_checksum
