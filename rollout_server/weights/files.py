"""LoadWeights: a path under the server's --weights-root, checked before the filesystem sees it, and
the safetensors weights or PEFT adapter stored there.

Every file read is checked on its own, after every link on its way is resolved: it must lie inside the
root and be a regular file. It is then opened without blocking (a FIFO or a device would otherwise
hold the open, and the process with it) and read through that open descriptor, so the file read is the
file checked even if the folder changes in between.
"""

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from rollout.v1 import rollout_pb2
from rollout_server.quoting import quoted
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


class OutsideRoot(PermissionError):
    """A path, or a link on its way, leads outside the server's --weights-root."""


def resolve_under(root: Path, requested: str) -> Path:
    """``requested`` (relative to ``root``, or absolute) with '..' and symbolic links resolved:
    OutsideRoot unless it lies inside ``root`` (itself resolved), FileNotFoundError if absent."""
    check_path(requested)
    path = _resolved(root / requested, requested)
    if not path.is_relative_to(root):
        raise OutsideRoot(f"{quoted(requested)} is outside the server's --weights-root")
    if not path.exists():
        raise FileNotFoundError(f"{quoted(requested)} does not exist under the server's --weights-root")
    return path


def regular_file(root: Path, file: Path) -> Path:
    """``file`` with every link resolved: OutsideRoot unless it lies inside ``root``, InvalidRequest on
    ``path`` unless it is a regular file (a FIFO, socket or device is never opened)."""
    resolved = _resolved(file, file.name)
    if not resolved.is_relative_to(root):
        raise OutsideRoot(f"{quoted(file.name)} links outside the server's --weights-root")
    try:
        mode = resolved.stat().st_mode
    except FileNotFoundError:
        raise reject("path", f"{quoted(file.name)} does not exist") from None
    if not stat.S_ISREG(mode):
        raise reject("path", f"{quoted(file.name)} is not a regular file")
    return resolved


def _resolved(path: Path, named: str) -> Path:
    try:
        return path.resolve()
    except RuntimeError as error:  # Python 3.11 reports a symbolic link loop this way
        raise reject("path", f"{quoted(named)} is a symbolic link loop") from error


@contextlib.contextmanager
def opened(file: Path) -> Iterator[Path]:
    """A path that reads the regular file ``file`` (from ``regular_file``) through a descriptor opened
    without blocking and without following a link, so a file swapped for a FIFO or a link after the
    check is refused, not waited on."""
    descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise reject("path", f"{quoted(file.name)} is not a regular file")
        yield Path(_DESCRIPTOR_FOLDER, str(descriptor))
    finally:
        os.close(descriptor)


# Opening an open descriptor's entry here opens the same file again (Linux: /proc/self/fd; macOS and
# the BSDs: /dev/fd).
_DESCRIPTOR_FOLDER = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


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
            config_file, weights_file = _check_size(
                [regular_file(root, path / name) for name in (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE)], max_bytes
            )
            with opened(config_file) as readable:
                config_json = readable.read_text()
            with opened(weights_file) as readable:
                tensors = {n.removeprefix(PEFT_SAVED_PREFIX): t for n, t in load_file(readable).items()}
        else:
            config_json, tensors = "", {}
            for file in _check_size(_weight_files(root, path, request.target or "transformer"), max_bytes):
                with opened(file) as readable:
                    tensors.update(load_file(readable))
    except OutsideRoot:
        raise
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


def _weight_files(root: Path, path: Path, target: str) -> list[Path]:
    """The checked safetensors files (``regular_file``) at ``path``."""
    if not path.is_dir():
        if path.suffix != ".safetensors":
            raise reject("path", f"{quoted(path.name)} is not a .safetensors file")
        return [regular_file(root, path)]
    if (path / "model_index.json").is_file():  # a pipeline: the targeted transformer is the policy
        path = path / target
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise reject("path", "no .safetensors weights there")
    return [regular_file(root, file) for file in files]
