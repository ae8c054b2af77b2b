"""The engine in process, on the real tiny model: a transformer exception fails only the rollouts
with rows in that forward; the others in the round finish, and the engine keeps serving."""

import asyncio

import pytest
import torch

from rollout.v1 import rollout_pb2
from rollout_server import families
from rollout_server.engine import Engine
from rollout_server.limits import Limits
from rollout_server.presets import defaults_for
from rollout_server.validation import ServingContext, resolve

TOKENS_AT_128PX = 64  # tiny-flux packs 16 x 16 pixels per token


@pytest.fixture(scope="module")
def engine(tiny_flux_folder):
    adapter = families.load(tiny_flux_folder, torch.device("cpu"), torch.float32)
    engine = Engine(lambda: adapter, "tiny-flux", Limits())
    yield engine
    engine.close()


def resolved(engine: Engine, **fields) -> rollout_pb2.RolloutRequest:
    adapter = engine.adapter
    defaults = defaults_for("tiny-flux", adapter.defaults())
    serving = ServingContext(adapter, defaults, Limits())
    return resolve(rollout_pb2.RolloutRequest(images=False, **fields), serving)


def run_together(engine: Engine, requests: list[rollout_pb2.RolloutRequest]) -> list[tuple[list, object]]:
    """(messages, error) of each request, all opened at once through the engine's facade."""

    async def main():
        streams = [engine.open_stream(request) for request in requests]

        async def drain(stream):
            messages, error = [], None
            try:
                async for message in stream:
                    messages.append(message)
            except Exception as failure:  # noqa: BLE001 - the rollout's outcome, compared below
                error = failure
            finally:
                stream.close()
            return messages, error

        return await asyncio.wait_for(asyncio.gather(*(drain(stream) for stream in streams)), timeout=120)

    return asyncio.run(main())


def test_a_model_exception_fails_only_the_rollouts_in_that_forward(engine):
    armed = True

    def fail_at_128px(module, args, kwargs):
        if armed and kwargs["hidden_states"].shape[1] == TOKENS_AT_128PX:
            raise RuntimeError("injected fault in a 128px forward")

    handle = engine.adapter.transformer.register_forward_pre_hook(fail_at_128px, with_kwargs=True)
    try:
        small = {"prompts": ["a red fox"], "samples_per_prompt": 2, "height": 64, "width": 64, "num_steps": 6}
        large = {**small, "height": 128, "width": 128}
        outcomes = run_together(
            engine,
            [resolved(engine, base_seed=1, **small), resolved(engine, base_seed=2, **large)]
            + [resolved(engine, base_seed=3, **small)],
        )
        (first, first_error), (failed, error), (second, second_error) = outcomes
        assert isinstance(error, RuntimeError) and "injected fault" in str(error)
        assert failed[0].HasField("started") and not any(m.HasField("step") for m in failed)
        for messages, no_error in ((first, first_error), (second, second_error)):
            assert no_error is None
            assert sum(m.HasField("step") for m in messages) == 6
            assert messages[-1].HasField("finished")
        assert first[-1].finished.shared_steps > 0 and second[-1].finished.shared_steps > 0
        armed = False
        ((messages, no_error),) = run_together(engine, [resolved(engine, base_seed=2, **large)])
        assert no_error is None and messages[-1].HasField("finished")
    finally:
        handle.remove()
