"""RolloutClient and RolloutPool are the same surface: every method of the RolloutSource protocol has,
in both, exactly the protocol's parameters (names, kinds, and defaults where the protocol fixes one)."""

import inspect

import pytest

from rollout_client import RolloutClient, RolloutPool, RolloutSource

METHODS = [
    name for name, member in vars(RolloutSource).items() if callable(member) and not name.startswith("_")
]


def test_the_protocol_covers_the_surface():
    assert sorted(METHODS) == ["close", "load_weights", "rollout", "server_info", "stream", "update_weights"]


@pytest.mark.parametrize("implementation", [RolloutClient, RolloutPool])
@pytest.mark.parametrize("method", METHODS)
def test_each_implementation_has_the_protocols_signature(implementation, method):
    expected = inspect.signature(getattr(RolloutSource, method))
    actual = inspect.signature(getattr(implementation, method))
    assert list(actual.parameters) == list(expected.parameters)
    for name, parameter in expected.parameters.items():
        assert actual.parameters[name].kind == parameter.kind, name
        if parameter.default is not Ellipsis:  # ...: each implementation chooses its own default
            assert actual.parameters[name].default == parameter.default, name
    assert actual.return_annotation == expected.return_annotation
