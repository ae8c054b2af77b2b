"""The trainer's weight averages: the EMA update against its closed form, the swap that leaves the
trained weights as they were (also when the block raises), and the old policy's ramped decay."""

import pytest
import torch

from rollout_client.train.averages import WeightAverage, ramped_decay


def test_the_average_is_the_exponential_moving_average_and_swaps_in_and_out():
    parameters = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.ones(2, 2))]
    average = WeightAverage(parameters)
    history = []
    for k in range(1, 4):
        with torch.no_grad():
            for p in parameters:
                p.fill_(float(k))
        history.append(float(k))
        average.update(parameters, 0.9)
    # a_0 = theta_0, a_k = 0.9 a_{k-1} + 0.1 k.
    expected = [0.0, 1.0]
    for k in history:
        expected = [0.9 * e + 0.1 * k for e in expected]
    # float32 against float64: three updates of values at most 3, each rounding by at most 2^-24
    # relative (about 2e-7 each), stay below 1e-6.
    for tensor, value in zip(average.tensors, expected, strict=True):
        assert torch.allclose(tensor, torch.full_like(tensor, value), atol=1e-6)
    with average.applied(parameters):
        assert torch.allclose(parameters[0], average.tensors[0])
    assert all((p == 3.0).all() for p in parameters)
    with pytest.raises(RuntimeError), average.applied(parameters):
        raise RuntimeError("a failed push")
    assert all((p == 3.0).all() for p in parameters)

    restored = WeightAverage(parameters)
    restored.load_state_dict(average.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.tensors, average.tensors, strict=True))
    with pytest.raises(ValueError, match="decay is in"):
        average.update(parameters, 1.5)


def test_the_old_policys_decay_ramps_up_then_holds():
    assert [ramped_decay(i, 0.5, 4) for i in range(7)] == [0.0, 0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert ramped_decay(0, 0.5, 0) == 0.5
