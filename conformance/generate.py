"""Record the conformance vectors: each tiny preset served by a real `rollout-server`, every case of
`rollout_client.conformance` (sampler x CFG mode x solver window) streamed from it and kept as the
kit's vector file `vectors/<model>.safetensors` (the format: README.md).

    python conformance/generate.py                      # every tiny preset that builds here
    python conformance/generate.py --model tiny-flux    # one

The servers run one torch thread, as the test suite's do, so a vector recorded again on this CPU is
bitwise the one committed (tests/test_conformance.py). tiny-qwen-image-edit's processor needs
torchvision; without it that preset is left out.
"""

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from google.protobuf import json_format
from replay import weights_digest  # beside this script: the replayer checks the digest it records
from safetensors.torch import save_file

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, Started, Step, conformance
from rollout_core.local_server import LocalServer
from rollout_server.presets import preset_names, resolve_model

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors"
FORMAT = 1


def tiny_presets() -> list[str]:
    """Every tiny preset whose libraries are installed here."""
    from transformers.utils import is_torchvision_available

    names = [name for name in preset_names() if name.startswith("tiny-")]
    if not is_torchvision_available():
        print("tiny-qwen-image-edit left out: its Qwen2VLProcessor needs torchvision", file=sys.stderr)
        names.remove("tiny-qwen-image-edit")
    return names


def _stored(store: dict[str, torch.Tensor], tensor: torch.Tensor) -> str:
    """The name of ``tensor`` in the file: its content's hash, so a tensor of several cases (the env,
    x_0 and the eps of one seed) is stored once."""
    tensor = tensor.detach().contiguous()
    digest = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode() + tensor.numpy().tobytes())
    name = f"t/{digest.hexdigest()[:16]}"
    store[name] = tensor
    return name


def _floats(values: torch.Tensor | None) -> list[float] | None:
    return None if values is None else [float(value) for value in values]


def record(case: conformance.Case, request, events, store: dict[str, torch.Tensor]) -> dict:
    """One case of a vector file from its request and stream (every latent streamed), its tensors
    added to ``store``: the latents a replay needs (x_0, both sides of every stochastic step, the
    final one), each stochastic step's eps, the env, and the expected log-probs."""
    started = next(e for e in events if isinstance(e, Started))
    steps = [e for e in events if isinstance(e, Step)]
    latents = [started.x0, *(step.x_next for step in steps)]
    stochastic = [step.index for step in steps if step.stochastic]
    kept = sorted({0, len(steps), *stochastic, *(i + 1 for i in stochastic)})
    message = rollout_pb2.RolloutStarted()
    message.CopyFrom(started.message)
    # Left out: the tensors (kept below), the env's JSON (in "env"), the request (sent as "request"), the
    # noise rule in words (once per file), and the control token (a secret of the rollout, new each time).
    for field in ("tensors", "env_json", "resolved", "noise_rule", "control_token"):
        message.ClearField(field)
    env = {
        branch: {
            str(p): {
                k: {"tensor": _stored(store, v)} if isinstance(v, torch.Tensor) else v for k, v in kw.items()
            }
            for p, kw in enumerate(per_prompt)
        }
        for branch, per_prompt in started.env.items()
    }
    vector = {
        "name": case.name,
        "request": json_format.MessageToDict(request, preserving_proto_field_name=True),
        "started": json_format.MessageToDict(message, preserving_proto_field_name=True),
        "env": env,
        "latents": {str(j): _stored(store, latents[j]) for j in kept},
        "eps": {str(i): _stored(store, steps[i].debug["eps"]) for i in stochastic},
        "log_probs": [_floats(step.log_probs) for step in steps],
    }
    if any(step.stream_log_probs for step in steps):  # several latent streams: each one's own
        vector["stream_log_probs"] = [{k: _floats(v) for k, v in s.stream_log_probs.items()} for s in steps]
    return vector


def record_model(
    client: RolloutClient, names: list[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and document of the served model's vector file (``names``: only those cases)."""
    info = client.server_info()
    store: dict[str, torch.Tensor] = {}
    recorded, noise_rule = [], ""
    for case in conformance.cases(info):
        if names is None or case.name in names:
            request = conformance.request(info, case)
            events = list(client.stream(request))
            noise_rule = next(e for e in events if isinstance(e, Started)).message.noise_rule
            recorded.append(record(case, request, events, store))
    folder = Path(info.model_path)
    experts = {name: weights_digest(_transformer(folder, name)) for name in info.transformers}
    document = {
        "format": FORMAT,
        "model": info.model,
        "family": info.family,
        "pipeline_class": info.pipeline_class,
        "weights_sha256": experts,
        "noise_rule": noise_rule,
        "versions": dict(sorted(info.versions.items())),
        "cases": recorded,
    }
    return store, document


def _transformer(folder: Path, component: str) -> torch.nn.Module:
    from diffusers import AutoModel

    return AutoModel.from_pretrained(str(folder), subfolder=component)


def write(path: Path, store: dict[str, torch.Tensor], document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        store, path, metadata={"conformance": json.dumps(document, sort_keys=True, separators=(",", ":"))}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        action="append",
        choices=sorted(preset_names()),
        help="a preset (default: every tiny one that builds)",
    )
    parser.add_argument("--out", type=Path, default=VECTORS, help=f"vector folder (default {VECTORS})")
    parser.add_argument("--cache-dir", type=Path, help="the preset cache (default: rollout-server's)")
    args = parser.parse_args(argv)
    cache = ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    for name in args.model or tiny_presets():
        resolve_model(name, args.cache_dir)  # built here: the server's start has a deadline, a build none
        with tempfile.TemporaryDirectory() as logs:
            server = LocalServer.start(Path(logs) / "server.log", "--model", name, "--threads", "1", *cache)
            try:
                with RolloutClient(server.address, timeout=600) as client:
                    store, document = record_model(client)
            finally:
                server.stop()
        path = args.out / f"{name}.safetensors"
        write(path, store, document)
        print(f"{path}: {len(document['cases'])} cases, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
