"""LoadWeights: a path under the server's --weights-root, checked before the filesystem sees it, and
the safetensors weights or PEFT adapter stored there."""

from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from rollout.v1 import rollout_pb2
from rollout_server.validation import quoted
from rollout_server.weights.spec import check_finite, check_target, check_version
from rollout_server.weights.update import FULL, LORA, WeightUpdate, reject

# Paths are checked before the filesystem sees them (Linux PATH_MAX and NAME_MAX).
MAX_PATH_CHARS = 4096
MAX_PATH_PART_BYTES = 255
PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PeftModel.save_pretrained prefixes the names it saves with this.
PEFT_SAVED_PREFIX = "base_model.model."


def check_path(requested: str) -> None:
    """InvalidRequest on ``path`` unless the filesystem can take ``requested`` as a path at all."""
    if "\0" in requested:
        raise reject("path", "must not contain a NUL character")
    if len(requested) > MAX_PATH_CHARS:
        raise reject("path", f"is {len(requested)} characters; at most {MAX_PATH_CHARS}")
    for part in Path(requested).parts:
        if len(part.encode(errors="surrogatepass")) > MAX_PATH_PART_BYTES:
            raise reject("path", f"the name {quoted(part)} is longer than {MAX_PATH_PART_BYTES} bytes")


def resolve_under(root: Path, requested: str) -> Path:
    """``requested`` (relative to ``root``, or absolute) with '..' and symbolic links resolved:
    PermissionError unless it lies inside ``root`` (itself resolved), FileNotFoundError if absent."""
    check_path(requested)
    try:
        path = (root / requested).resolve()
    except RuntimeError as error:  # Python 3.11 reports a symbolic link loop this way
        raise reject("path", f"{quoted(requested)} is a symbolic link loop") from error
    if not path.is_relative_to(root):
        raise PermissionError(f"{quoted(requested)} is outside the server's --weights-root")
    if not path.exists():
        raise FileNotFoundError(f"{quoted(requested)} does not exist under the server's --weights-root")
    return path


def read_update(
    root: Path, request: rollout_pb2.LoadWeightsRequest, current_version: int, max_bytes: int, experts
) -> WeightUpdate:
    """The update stored at ``request.path`` under ``root``: a PEFT adapter folder (LORA), or the
    safetensors weights of a file, a diffusers model folder or a pipeline folder's ``target``. A
    stale version, or files of more than ``max_bytes`` in all, are refused before anything is read;
    non-finite values once read."""
    check_target(request.target or "transformer", experts, "target")
    check_version(request.policy_version, current_version, "policy_version")
    path = resolve_under(root, request.path)
    try:
        is_adapter = (path / PEFT_CONFIG_FILE).is_file()
        kind = request.kind or (LORA if is_adapter else FULL)
        if (kind == LORA) != is_adapter:
            raise reject(
                "kind", f"{quoted(request.path)} {'is' if is_adapter else 'is not'} a PEFT adapter folder"
            )
        if is_adapter:
            _check_size([path / PEFT_CONFIG_FILE, path / PEFT_WEIGHTS_FILE], max_bytes)
            config_json = (path / PEFT_CONFIG_FILE).read_text()
            tensors = {
                n.removeprefix(PEFT_SAVED_PREFIX): t for n, t in load_file(path / PEFT_WEIGHTS_FILE).items()
            }
        else:
            config_json, tensors = "", {}
            for file in _check_size(_weight_files(path, request.target or "transformer"), max_bytes):
                tensors.update(load_file(file))
    except (OSError, SafetensorError, UnicodeDecodeError) as error:
        raise reject("path", f"cannot read the weights: {quoted(str(error))}") from error
    for name, tensor in tensors.items():
        check_finite(name, tensor)
    return WeightUpdate(
        policy_version=request.policy_version,
        kind=kind,
        tensors=tensors,
        nbytes=sum(t.nbytes for t in tensors.values()),
        lora_config_json=config_json,
        adapter_name=request.adapter_name,
        target=request.target or "transformer",
    )


def _check_size(files: list[Path], max_bytes: int) -> list[Path]:
    """``files``, unless together they are larger than an update may be (InvalidRequest on ``path``)."""
    size = sum(file.stat().st_size for file in files)
    if size > max_bytes:
        raise reject("path", f"the weights there are {size} bytes; an update is at most {max_bytes}")
    return files


def _weight_files(path: Path, target: str) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise reject("path", f"{quoted(path.name)} is not a .safetensors file")
        return [path]
    if (path / "model_index.json").is_file():  # a pipeline: the targeted transformer is the policy
        path = path / target
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise reject("path", "no .safetensors weights there")
    return files
