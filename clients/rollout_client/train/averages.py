r"""Running averages of the trained tensors, for the policies a run keeps beside the one it trains.

A ``WeightAverage`` holds one tensor per trained parameter and moves it towards the parameters by

    average <- decay * average + (1 - decay) * theta

(``decay`` 0: a copy of theta; 1: frozen). The trainer keeps two kinds:

* the EMA of ``--ema-decay`` (updated after every iteration): the weights its evals push and its
  run ends with, and AWM's KL target;
* DiffusionNFT's old policy (``--nft-old-decay``): the weights the server rolls out with and the
  loss's ``v_old``, updated after each iteration's optimizer steps with a decay that ramps up
  (``ramped_decay``), so it follows the trained policy at first and more slowly later.

``applied(parameters)`` swaps the average into the parameters for a block (a push, a forward with no
gradient) and puts theta back after it, whatever happens inside. ``base_model(transformer)`` does the
same for the base model a LoRA run trains from: its adapters are disabled inside the block.
"""

import contextlib
from collections.abc import Iterator, Sequence

import torch


class WeightAverage:
    def __init__(self, parameters: Sequence[torch.Tensor]):
        self.tensors = [p.detach().clone() for p in parameters]

    @torch.no_grad()
    def update(self, parameters: Sequence[torch.Tensor], decay: float) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"an average's decay is in [0, 1], got {decay}")
        for average, parameter in zip(self.tensors, parameters, strict=True):
            average.mul_(decay).add_(parameter.detach(), alpha=1 - decay)

    @contextlib.contextmanager
    def applied(self, parameters: Sequence[torch.Tensor]) -> Iterator[None]:
        """The parameters hold the average inside the block, their own values again after it."""
        own = [p.detach().clone() for p in parameters]
        with torch.no_grad():
            for parameter, average in zip(parameters, self.tensors, strict=True):
                parameter.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for parameter, value in zip(parameters, own, strict=True):
                    parameter.copy_(value)

    def state_dict(self) -> list[torch.Tensor]:
        return [t.detach().cpu().clone() for t in self.tensors]

    def load_state_dict(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.tensors):
            raise ValueError(
                f"the checkpoint's average has {len(tensors)} tensors, this policy {len(self.tensors)}"
            )
        for average, saved in zip(self.tensors, tensors, strict=True):
            average.copy_(saved)


@contextlib.contextmanager
def base_model(transformer: torch.nn.Module) -> Iterator[None]:
    """The transformer is its base model inside the block (its LoRA disabled), the policy again after."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def ramped_decay(iteration: int, most: float, ramp: int) -> float:
    """DiffusionNFT's schedule of the old policy's decay: 0 at iteration 0, rising linearly to ``most``
    at iteration ``ramp`` (at once when ``ramp`` is 0), then held."""
    return most if ramp == 0 else most * min(iteration / ramp, 1.0)
