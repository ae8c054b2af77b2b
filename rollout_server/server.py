"""The gRPC front end: RolloutService, standard health checking and reflection, graceful shutdown;
and the HTTP front end beside it when asked for."""

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import rollout_server
from rollout.v1 import rollout_pb2
from rollout_core import dtypes, solvers, steps, wire
from rollout_server import families, memory, presets
from rollout_server.auth import HANDLER_KINDS, ServerTLS, TokenInterceptor, TokenPolicy, exposure_warning
from rollout_server.engine import Engine
from rollout_server.errors import StartupError
from rollout_server.http_api import HttpFrontEnd, HttpServer
from rollout_server.limits import DEFAULT_HTTP_READ_SECONDS, DEFAULT_MAX_HTTP_RESPONSE_BYTES, Limits
from rollout_server.metrics import ServerMetrics
from rollout_server.parallel import SequenceParallel
from rollout_server.prompt_cache import DEFAULT_PROMPT_CACHE_ENTRIES
from rollout_server.service import RolloutService
from rollout_server.validation import ServingContext, defaults_proto
from rollout_server.weights import upload

log = logging.getLogger("rollout_server")
SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
SERVICE_NAME = SERVICE.full_name
# How often a shutting-down server checks whether its rollouts have finished.
_DRAIN_POLL_SECONDS = 0.05
# How long the rollouts ended at shutdown have to send their status before their calls are cut.
_STATUS_SECONDS = 2.0
# Methods whose requests have a parser of their own (see upload.parse_update_message).
_REQUEST_PARSERS = {"UpdateWeights": upload.parse_update_message}


@dataclass(frozen=True)
class ServerOptions:
    model: str = "tiny-flux"
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    dtype: str = "float32"
    grace_seconds: float = 10.0
    limits: Limits = Limits()
    cache_dir: Path | None = None
    model_path: Path | None = None  # model resolved (and built, for a preset) beforehand
    parallel: SequenceParallel = field(default_factory=SequenceParallel)
    weights_root: Path | None = None  # LoadWeights reads only under it (resolved); None disables it
    tls: ServerTLS | None = None  # None: plaintext
    tokens: TokenPolicy = TokenPolicy()
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no metrics endpoint
    upload_idle_seconds: float = 30.0  # an UpdateWeights stream silent this long is dropped
    prompt_cache_entries: int = DEFAULT_PROMPT_CACHE_ENTRIES  # distinct texts kept encoded; 0: none
    http_port: int | None = None  # SGLang's HTTP rollout API on this port too (see http_api.py)
    max_http_response_bytes: int = DEFAULT_MAX_HTTP_RESPONSE_BYTES
    http_read_seconds: float = DEFAULT_HTTP_READ_SECONDS  # to read one HTTP request, headers and body


def versions() -> dict[str, str]:
    packages = ("torch", "diffusers", "transformers", "grpcio", "protobuf", "safetensors")
    return {"rollout-server": rollout_server.__version__, **{name: version(name) for name in packages}}


def build_engine(
    options: ServerOptions,
    metrics: ServerMetrics | None = None,
    on_fatal: Callable[[Exception], None] | None = None,
) -> Engine:
    """Load the model (split across the sequence-parallel ranks, if any) into an engine."""
    folder = options.model_path or presets.resolve_model(options.model, options.cache_dir)
    device = options.parallel.device(options.device)
    dtype = dtypes.BY_NAME[options.dtype]

    def load() -> families.base.FamilyAdapter:
        adapter = families.load(folder, device, dtype)
        for expert in adapter.experts.values():
            options.parallel.split_transformer(expert)
        return adapter

    return Engine(
        load,
        options.model,
        options.limits,
        options.parallel,
        options.prompt_cache_entries,
        metrics,
        on_fatal,
    )


def features(adapter: families.base.FamilyAdapter, weights_root: Path | None) -> list[str]:
    """GetServerInfo.features: the optional capabilities this server has (see rollout_core.wire)."""
    # Every family's transformer takes PEFT adapters.
    names = [wire.FEATURE_LORA, wire.FEATURE_TREE, wire.FEATURE_PRUNE_POINTS, wire.FEATURE_WEIGHT_SYNC]
    names += [wire.FEATURE_SIGMAS, wire.FEATURE_INITIAL_LATENTS, wire.FEATURE_RELEASE_MEMORY]
    names.append(wire.FEATURE_PREVIEWS)
    if weights_root is not None:
        names.append(wire.FEATURE_LOAD_WEIGHTS)
    if adapter.max_frames > 1:
        names.append(wire.FEATURE_VIDEO)
    if len(adapter.experts) > 1:
        names.append(wire.FEATURE_EXPERTS)
    if adapter.boundary_ratio is not None:
        names += [wire.FEATURE_GUIDANCE_SCALE_2, wire.FEATURE_BOUNDARY_RATIO]
    if adapter.takes_images:
        names.append(wire.FEATURE_CONDITION_IMAGES)
    defaults = adapter.defaults()
    if adapter.latent_streams(families.base.MediaShape(defaults.frames, defaults.height, defaults.width)):
        names.append(wire.FEATURE_LATENT_STREAMS)
    if adapter.decodes_audio:
        names.append(wire.FEATURE_AUDIO)
    return names


def decode_info(adapter: families.base.FamilyAdapter) -> rollout_pb2.DecodeInfo:
    """GetServerInfo.decode: what each sample decodes to, as the adapter states it."""
    video = adapter.max_frames > 1
    info = rollout_pb2.DecodeInfo(
        media=rollout_pb2.MEDIA_KIND_VIDEO if video else rollout_pb2.MEDIA_KIND_IMAGE,
        frame_rate=adapter.frame_rate if video else 0.0,
    )
    if adapter.decodes_audio:
        info.audio_sample_rate, info.audio_channels = adapter.sound_format()
    return info


def build_service(options: ServerOptions, on_fatal: Callable[[Exception], None]) -> RolloutService:
    """Load the model and assemble the servicer (no network yet); ``on_fatal`` is called from the
    engine's worker thread when the server must go down."""
    metrics = ServerMetrics()
    engine = build_engine(options, metrics, on_fatal)
    adapter, limits = engine.adapter, options.limits
    defaults = presets.defaults_for(options.model, adapter.defaults())
    serving = ServingContext.of(adapter, defaults, limits, options.parallel.dims.seq_len_divisor)
    info = rollout_pb2.GetServerInfoResponse(
        model=options.model,
        model_path=str(adapter.folder),
        family=adapter.family,
        pipeline_class=adapter.pipeline_type.__name__,
        dtype=options.dtype,
        device=str(adapter.device),
        sp_degree=options.parallel.degree,
        transformers=list(adapter.experts),
        attention_split=options.parallel.attention_split,
        sampler_types=list(steps.SAMPLERS_BY_ENUM),
        solvers=list(solvers.SOLVERS_BY_ENUM),
        defaults=defaults_proto(serving),
        limits=limits.to_proto(
            adapter.side_multiple, adapter.min_side, adapter.max_frames, adapter.frame_step
        ),
        versions=versions(),
        # A model without CFG states no field to turn it on with.
        cfg_scale_field=serving.cfg_scale_field if serving.has_cfg else "",
        cfg_rule=adapter.cfg_rule if serving.has_cfg else "none",
        cfg_off_scale=adapter.cfg_off_scale,
        scale_fields=serving.scale_fields,
        timestep_rule=adapter.timestep_rule,
        features=features(adapter, options.weights_root),
        lora_targets=adapter.lora_targets,
        decode=decode_info(adapter),
    )
    info.limits.max_update_bytes = engine.max_update_bytes
    info.limits.max_request_bytes = serving.max_request_bytes
    info.limits.memory_budget_bytes = engine.memory_budget.limit
    return RolloutService(engine, metrics, serving, info, options.weights_root, options.upload_idle_seconds)


def _parse_or_none(message_type):
    """A request deserializer that gives the handler None for bytes that are not a ``message_type``,
    so it can answer INVALID_ARGUMENT (gRPC itself would answer INTERNAL and log a traceback)."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError:
            return None

    return parse


def add_rollout_service(service: RolloutService, server: grpc.aio.Server) -> None:
    """Register ``service`` as the generated ``add_RolloutServiceServicer_to_server`` does, with
    request deserializers that give the handler None for bytes that do not parse."""
    handlers = {
        method.name: HANDLER_KINDS[method.client_streaming, method.server_streaming](
            getattr(service, method.name),
            request_deserializer=_REQUEST_PARSERS.get(method.name)
            or _parse_or_none(getattr(rollout_pb2, method.input_type.name)),
            response_serializer=getattr(rollout_pb2, method.output_type.name).SerializeToString,
        )
        for method in SERVICE.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class RolloutServer:
    """A running gRPC server: ``await start()``, then ``await stop()`` (or wait for a signal)."""

    def __init__(
        self,
        service: RolloutService,
        host: str,
        port: int,
        grace_seconds: float,
        tls: ServerTLS | None = None,
        tokens: TokenPolicy | None = None,
        http: HttpServer | None = None,
    ):
        self.service = service
        self.grace_seconds = grace_seconds
        self.http = http  # the HTTP front end, started and stopped with this server
        metrics = service.metrics
        interceptors = []
        if tokens is not None and tokens.enabled:
            interceptors.append(TokenInterceptor(tokens, lambda code: metrics.reject(code.name.lower())))
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", service.serving.limits.max_message_bytes),
                # The largest request the limits admit, its conditioning images included.
                ("grpc.max_receive_message_length", service.serving.max_request_bytes),
                ("grpc.so_reuseport", 0),
            ],
            interceptors=interceptors,
        )
        add_rollout_service(service, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        if tls is None:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        else:
            try:
                self.port = self.server.add_secure_port(f"{host}:{port}", tls.server_credentials())
            except RuntimeError:  # gRPC's error for a key that does not fit the certificate, too
                raise StartupError(
                    f"cannot serve TLS on {host}:{port}: the address is taken, or --tls-key does not "
                    "belong to --tls-cert"
                ) from None
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        """Drain, then close: health goes NOT_SERVING and new calls get UNAVAILABLE "shutting down"
        while the running rollouts get the grace period. Then the engine stops after its current
        round, ending what is left with UNAVAILABLE "the server is shutting down", and the listener
        closes once those statuses are out (a client that reads nothing meanwhile is cut off after
        ``_STATUS_SECONDS``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_seconds
        self.service.begin_shutdown()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        while self.service.engine.status().in_flight and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_SECONDS)
        await asyncio.to_thread(self.service.engine.close)  # the loop must keep running meanwhile
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(_STATUS_SECONDS)

    async def serve_until_stopped(self, fatal: asyncio.Future) -> int:
        """Serve until SIGINT/SIGTERM (exit code 0) or until ``fatal`` gets the error that brought the
        engine down (exit code 1)."""
        signalled = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signalled.set)
        waiting = asyncio.ensure_future(signalled.wait())
        await asyncio.wait({waiting, fatal}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if fatal.done():
            log.error("fatal: %s", fatal.result())
        log.info("shutting down (grace %g s)", self.grace_seconds)
        await self.stop()
        return 1 if fatal.done() else 0


async def serve(options: ServerOptions) -> int:
    """Rank 0 (or the only rank): the gRPC front end. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    fatal = loop.create_future()

    def on_fatal(error: Exception) -> None:  # on the engine's worker thread
        loop.call_soon_threadsafe(lambda: fatal.done() or fatal.set_result(error))

    service = build_service(options, on_fatal)
    try:
        http = None
        if options.http_port is not None:
            front_end = HttpFrontEnd(service, options.tokens, options.max_http_response_bytes)
            http = HttpServer(
                front_end, options.host, options.http_port, options.tls, options.http_read_seconds
            )
        server = RolloutServer(
            service, options.host, options.port, options.grace_seconds, options.tls, options.tokens, http
        )
    except BaseException:
        await asyncio.to_thread(service.engine.close)  # a startup error leaves no worker behind
        raise
    await server.start()
    if options.metrics_port is not None:
        host = options.metrics_host
        try:
            port = service.metrics.serve(host, options.metrics_port)
        except (OSError, OverflowError) as error:
            await server.stop()
            raise StartupError(f"cannot serve metrics on {host}:{options.metrics_port}: {error}") from None
        log.info("metrics at http://%s:%d/metrics", host, port)
    log.info("security: %s", describe_security(options))
    budget = memory.format_bytes(service.engine.memory_budget.limit)
    log.info("memory budget: %s for the running rollouts above the model", budget)
    warning = exposure_warning(options.host, options.tokens.enabled)
    if warning:
        log.warning("\n%s", warning)
    info = service.server_info
    if server.http is not None:
        log.info("SGLang-compatible HTTP API at %s (POST /rollout/generate)", server.http.address)
    log.info(
        "serving %s (%s, %s on %s) at %s", info.model, info.family, info.dtype, info.device, server.address
    )
    return await server.serve_until_stopped(fatal)


def describe_security(options: ServerOptions) -> str:
    """One line for the log: transport and tokens, never a token itself."""
    if options.tls is None:
        transport = "plaintext"
    elif options.tls.client_ca is None:
        transport = "TLS"
    else:
        transport = "mutual TLS (client certificates required)"
    tokens = options.tokens
    named = (("rollout", tokens.rollout_token), ("admin", tokens.admin_token))
    return f"{transport}, tokens: {', '.join(name for name, token in named if token) or 'none'}"


def follow(options: ServerOptions) -> int:
    """A non-zero sequence-parallel rank: load the model and run what rank 0 broadcasts. Ctrl-C in a
    terminal, or torchrun passing on a SIGTERM, reaches every rank; rank 0 alone decides when the
    group stops (it lets the running rollouts finish, then tells the others)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    build_engine(options).follow()
    return 0
