"""The tensors of an HTTP ``update_weights_from_tensor`` body: data, never a pickle.

SGLang's ``serialized_named_tensors`` entries are base64 pickles (its ``MultiprocessingSerializer``) of
tensors or of CUDA IPC handles to them, and loading a pickle runs whatever code it names. Here the one
entry is data, in one of two layouts (``load_format``):

* ``"safetensors"`` (the default): the bytes ``safetensors.torch.save`` returns;
* ``"flattened_bucket"``: SGLang's flattened bucket as data, an object with ``flattened_tensor`` (the
  bucket's bytes: its tensors' bytes one after the other) and ``metadata``, one object per tensor with
  the fields of SGLang's ``FlattenedTensorMetadata``: ``name``, ``shape``, ``dtype`` (``"torch.float32"``
  or ``"float32"``), and ``start_idx``, ``end_idx``, ``numel`` counted in bytes of the bucket.

Bytes are msgpack binary, or base64 text (JSON has no bytes). Either layout may come in an object keyed
by the module it updates, as SGLang's trainers wrap their buckets. Each tensor is built in a buffer of
its own by the UpdateWeights stream's assembler (``upload.TensorAssembler``), through the same checks:
dtypes, shapes, offsets that tile the data exactly, and finite values.
"""

import binascii
import json
from collections import defaultdict
from collections.abc import Iterable

import torch

from rollout_core.dtypes import BY_NAME, SAFETENSORS_NAMES
from rollout_server.quoting import quoted
from rollout_server.weights.files import PEFT_SAVED_PREFIX
from rollout_server.weights.spec import HEADER_ALLOWANCE_BYTES, check_finite
from rollout_server.weights.update import reject
from rollout_server.weights.upload import MalformedBuffer, TensorAssembler, layout_entries

SAFETENSORS, FLATTENED_BUCKET = "safetensors", "flattened_bucket"
LOAD_FORMATS = (SAFETENSORS, FLATTENED_BUCKET)
FIELD = "serialized_named_tensors"
ACCEPTED = (
    "send safetensors bytes, or with load_format flattened_bucket an object of flattened_tensor bytes "
    "and metadata (bytes as msgpack binary or base64 text); see docs/sglang-compat.md"
)
# A pickle of protocol 2 or later opens with the PROTO opcode and its protocol number.
_PICKLE_PROTO, _PICKLE_PROTOCOLS = 0x80, range(2, 6)
_LENGTH_BYTES = 8  # a safetensors buffer opens with its JSON header's length, then the header: "{..."
_LORA_PARTS = (".lora_A", ".lora_B")


def decode(
    entry: object, load_format: str, target: str, max_bytes: int
) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors, payload bytes) of one ``serialized_named_tensors`` entry for module ``target``;
    InvalidRequest on the field if it is not data in ``load_format`` (a pickle among them), holds
    more than ``max_bytes``, or a tensor that is malformed or not finite. The entry is taken: base64
    text is dropped once decoded, before the tensors are built, if the caller holds no reference."""
    entry = _unwrapped(entry, target)
    if load_format == FLATTENED_BUCKET:
        return _bucket(entry, max_bytes)
    data = _bytes(entry, FIELD, max_bytes)
    del entry  # the text
    if data[_LENGTH_BYTES : _LENGTH_BYTES + 1] != b"{":
        raise reject(FIELD, _not_data(data, "safetensors bytes"))
    assembler = TensorAssembler(len(data), HEADER_ALLOWANCE_BYTES, check_finite)
    return _assembled(assembler, data), len(data)


def _unwrapped(entry: object, target: str) -> object:
    """The payload of ``entry``, taken out of an object keyed by module name if it is one."""
    if not isinstance(entry, dict) or "flattened_tensor" in entry:
        return entry
    if list(entry) != [target]:
        modules = ", ".join(quoted(str(key), 64) for key in list(entry)[:8])
        raise reject(
            FIELD,
            f"an object of payloads by module must hold the updated module {quoted(target)} alone, "
            f"not {modules}",
        )
    return entry[target]


def _bytes(value: object, field: str, max_bytes: int) -> bytes:
    """``value`` as bytes: msgpack binary as it is, text as base64; at most ``max_bytes`` of them."""
    if isinstance(value, str):
        if len(value) // 4 * 3 > max_bytes:
            raise reject(field, f"holds about {len(value) // 4 * 3} bytes; an update is at most {max_bytes}")
        try:
            # Strict: the base64 alphabet and padding alone; read from the text as it is, no copy.
            value = binascii.a2b_base64(value, strict_mode=True)
        except ValueError as error:  # binascii.Error, or text that is not ASCII
            raise reject(field, f"is text but not base64: {quoted(str(error))}; {ACCEPTED}") from None
    if not isinstance(value, bytes):
        raise reject(field, f"must be bytes (msgpack binary) or base64 text, not {_kind(value)}; {ACCEPTED}")
    if len(value) > max_bytes:
        raise reject(field, f"holds {len(value)} bytes; an update is at most {max_bytes}")
    return value


def _not_data(data: bytes, expected: str) -> str:
    """Why ``data`` is refused where ``expected`` was due: a pickle is named as one."""
    if len(data) > 1 and data[0] == _PICKLE_PROTO and data[1] in _PICKLE_PROTOCOLS:
        return (
            "is a Python pickle (SGLang's MultiprocessingSerializer): this server never unpickles "
            f"network input, which could run code; {ACCEPTED}"
        )
    return f"is not {expected}; {ACCEPTED}"


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _bucket(bucket: object, max_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a flattened bucket sent as data (the module docstring)."""
    if isinstance(bucket, str | bytes):  # SGLang's own bucket is a pickle of tensors
        raise reject(FIELD, _not_data(_bytes(bucket, FIELD, max_bytes), "a flattened bucket object"))
    if not isinstance(bucket, dict):
        raise reject(FIELD, f"must be an object of flattened_tensor and metadata, not {_kind(bucket)}")
    metadata = bucket.get("metadata")
    if not isinstance(metadata, list) or not metadata:
        raise reject(f"{FIELD}.metadata", "must be a non-empty list of objects, one per tensor")
    header = {}
    for index, item in enumerate(metadata):
        name, entry = _bucket_entry(item, f"{FIELD}.metadata[{index}]")
        if name in header:
            raise reject(f"{FIELD}.metadata[{index}].name", f"{quoted(name)} is named twice")
        header[name] = entry
    data = _bytes(bucket.pop("flattened_tensor", None), f"{FIELD}.flattened_tensor", max_bytes)
    try:
        entries = layout_entries(header, len(data))
    except MalformedBuffer as error:
        raise reject(f"{FIELD}.metadata", str(error)) from None
    return _assembled(TensorAssembler.of_layout(entries, check_finite), data), len(data)


def _bucket_entry(item: object, field: str) -> tuple[str, dict]:
    """(name, safetensors header entry) of one ``FlattenedTensorMetadata`` object."""
    if not isinstance(item, dict):
        raise reject(field, f"must be an object, not {_kind(item)}")
    name, dtype = item.get("name"), item.get("dtype")
    if not isinstance(name, str):
        raise reject(f"{field}.name", f"must be a string, not {_kind(name)}")
    torch_dtype = BY_NAME.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else None
    if torch_dtype is None:
        raise reject(f"{field}.dtype", f"must be one of {sorted(BY_NAME)}, as torch names them")
    start, end, numel = (item.get(key) for key in ("start_idx", "end_idx", "numel"))
    if not (all(type(value) is int for value in (start, end, numel)) and numel == end - start):
        raise reject(
            field, "start_idx, end_idx and numel must be integers (bytes), numel = end_idx - start_idx"
        )
    return name, {
        "dtype": SAFETENSORS_NAMES[torch_dtype],
        "shape": item.get("shape"),
        "data_offsets": [start, end],
    }


def _assembled(assembler: TensorAssembler, data: bytes) -> dict[str, torch.Tensor]:
    try:
        assembler.feed(data)
        return assembler.result()
    except MalformedBuffer as error:
        raise reject(FIELD, str(error)) from None


def lora_adapter(
    tensors: dict[str, torch.Tensor], rank: int | None, alpha: float | None, modules: Iterable[str]
) -> tuple[dict[str, torch.Tensor], str]:
    """(tensors under PEFT's names, LoraConfig JSON) of SGLang's ``lora_merge`` payload on a transformer
    whose modules are ``modules``. A tensor named ``<module>.lora_A...`` or ``<module>.lora_B...`` is
    PEFT's ``<module>.lora_A.weight`` or ``<module>.lora_B.weight`` (a PeftModel's ``base_model.model.``
    prefix dropped); the rank is the rows of the lora_A
    tensors (one for every module; ``rank``, if given, must agree), the alpha ``alpha`` or else the rank,
    as SGLang takes them; the adapter wraps exactly the modules named (``target_modules``)."""
    renamed = {}
    for name, tensor in tensors.items():
        part = next((part for part in _LORA_PARTS if part in name), None)
        if part is None:
            raise reject(
                FIELD,
                f"tensor {quoted(name)} is not a LoRA tensor: weight_update_mode lora_merge takes "
                "<module>.lora_A.weight and <module>.lora_B.weight",
            )
        module = name.split(part, 1)[0].removeprefix(PEFT_SAVED_PREFIX)
        peft_name = f"{module}{part}.weight"
        if peft_name in renamed:
            raise reject(FIELD, f"tensor {quoted(name)} is a second {quoted(peft_name)}")
        renamed[peft_name] = tensor
    ranks = sorted(
        {tensor.shape[0] for name, tensor in renamed.items() if ".lora_A." in name and tensor.dim()}
    )
    if len(ranks) != 1:
        shared = f"they have {ranks[:8]}" if ranks else "there is none"
        raise reject(FIELD, f"the lora_A tensors must share one rank (their rows); {shared}")
    if rank is not None and rank != ranks[0]:
        raise reject("lora_rank", f"is {rank}, but the lora_A tensors have rank {ranks[0]}")
    adapted = {name.split(".lora_", 1)[0] for name in renamed}
    config = {"r": ranks[0], "lora_alpha": ranks[0] if alpha is None else alpha}
    config["target_modules"] = _target_modules(adapted, modules)
    return renamed, json.dumps(config)


def _target_modules(adapted: set[str], modules: Iterable[str]) -> list[str]:
    """PEFT ``target_modules`` that select exactly ``adapted`` among ``modules``: for each module the
    shortest dotted suffix of its path that no other module's path ends with (PEFT selects a module
    whose path is an entry or ends with ``.`` and one), so an adapter on every block's ``to_q`` reads
    ``to_q``, not one path per block. Modules not among ``modules`` are named whole: the check then
    refuses them."""
    ending_with = defaultdict(set)
    for module in modules:
        parts = module.split(".")
        for start in range(len(parts)):
            ending_with[".".join(parts[start:])].add(module)
    targets = set()
    for module in adapted:
        parts = module.split(".")
        suffixes = (".".join(parts[start:]) for start in range(len(parts) - 1, -1, -1))
        targets.add(next((s for s in suffixes if s in ending_with and ending_with[s] <= adapted), module))
    return sorted(targets)
