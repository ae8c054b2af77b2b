"""What a run checks before it steps or checkpoints: a reward, a loss, a gradient or a weight that holds a
NaN or an infinity stops the run (``NonFinite``) before any optimizer step or checkpoint is taken on it,
so the last good checkpoint stays on disk."""

from collections.abc import Iterable

import torch


class NonFinite(RuntimeError):
    """The run stopped on a non-finite reward, loss, gradient or weight; the message says which, at which
    iteration, and where the last good checkpoint is."""


def non_finite_tensor(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """``"NAME holds nan"`` (or ``inf``) for the first tensor holding a NaN or an infinity, or None when
    all are finite; None entries (a parameter without a gradient) are skipped. One host sync for all."""
    named = [(name, tensor) for name, tensor in named if tensor is not None]
    if not named:
        return None
    finite = torch.stack([tensor.isfinite().all() for _, tensor in named]).tolist()
    for (name, tensor), ok in zip(named, finite, strict=True):
        if not ok:
            return f"{name} holds {'nan' if tensor.isnan().any() else 'inf'}"
    return None
