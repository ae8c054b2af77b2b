"""The one table of tensor dtypes: torch's, the names the server and the trainer use for them, their
safetensors names on the wire, and which of them latents may be streamed in (rollout.v1 TensorDtype).
"""

from dataclasses import dataclass

import torch

from rollout.v1 import rollout_pb2


@dataclass(frozen=True)
class Dtype:
    torch: torch.dtype
    name: str  # as --dtype, TransformerCall.model_dtype and the CLIs spell it
    safetensors: str  # in safetensors headers and the manifests
    latent: int | None = None  # the rollout.v1 TensorDtype latents may be streamed in, if any


TABLE = (
    Dtype(torch.float32, "float32", "F32", rollout_pb2.TENSOR_DTYPE_FLOAT32),
    Dtype(torch.bfloat16, "bfloat16", "BF16", rollout_pb2.TENSOR_DTYPE_BFLOAT16),
    Dtype(torch.float16, "float16", "F16", rollout_pb2.TENSOR_DTYPE_FLOAT16),
    Dtype(torch.float64, "float64", "F64"),
    Dtype(torch.int64, "int64", "I64"),
    Dtype(torch.int32, "int32", "I32"),
    Dtype(torch.int16, "int16", "I16"),
    Dtype(torch.int8, "int8", "I8"),
    Dtype(torch.uint8, "uint8", "U8"),
    Dtype(torch.bool, "bool", "BOOL"),
)
BY_SAFETENSORS = {dtype.safetensors: dtype.torch for dtype in TABLE}
SAFETENSORS_NAMES = {dtype.torch: dtype.safetensors for dtype in TABLE}
BY_NAME = {dtype.name: dtype.torch for dtype in TABLE}
NAMES = {dtype.torch: dtype.name for dtype in TABLE}
# Latent dtypes by rollout.v1 TensorDtype, and the model dtypes a server runs in: the floating ones.
LATENT = {dtype.latent: dtype.torch for dtype in TABLE if dtype.latent is not None}
MODEL_DTYPE_NAMES = tuple(dtype.name for dtype in TABLE if dtype.latent is not None)
