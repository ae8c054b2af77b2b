"""docs/replay.md, run as written: a diffusers pipeline whose scheduler is set up by the page's
``SCHEDULERS`` and ``use_server_schedule`` reproduces a server's ODE rollout step by step, from the
streamed x_0 and env, bitwise: FluxPipeline with each solver's scheduler (Euler also through the
pipeline's ``sigmas`` argument), and WanPipeline with UniPC over its integer timesteps. The obvious
setup the page warns against (DPM-Solver++ on its own flow sigmas) does not."""

import re
from pathlib import Path

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler
from support.families import family_request
from support.parity import TOLERANCE
from support.requests import split_events
from support.servers import at_server_threads

from rollout.v1 import rollout_pb2
from rollout_core import solvers

DOC = Path(__file__).resolve().parents[1] / "docs" / "replay.md"


def run_doc_blocks(count: int, **names) -> dict:
    """The names docs/replay.md's first ``count`` Python blocks define, run in order after ``names``."""
    namespace = dict(names)
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)[:count]:
        exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def replay_doc() -> dict:
    """The scheduler settings and ``use_server_schedule`` of the page's first block."""
    return run_doc_blocks(1)


def server_ode(client, family: str, solver: str | None):
    """An ODE rollout of the family's two prompts, one sample each, CFG off: its started event and
    trajectories (``solver`` None: the family's own)."""
    fields = {} if solver is None else {"solver": solvers.SOLVERS[solver].enum}
    run = split_events(
        client.stream(family_request(family, "ODE", cfg=False, samples_per_prompt=1, **fields))
    )
    return run.started.message, run.trajectories()


def positive_env(trajectories, key: str) -> torch.Tensor:
    """The samples' env entry ``key`` of the positive branch, one row each: the server's text states."""
    return torch.cat([trajectory.env["positive"][key] for trajectory in trajectories])


def run_pipeline(pipe, scheduler, **arguments) -> list[torch.Tensor]:
    """x_1 .. x_T of the pipeline's own loop with ``scheduler``, at the servers' thread count."""
    latents = []

    def record(pipe, step, timestep, tensors):
        latents.append(tensors["latents"])
        return {}

    own, pipe.scheduler = pipe.scheduler, scheduler
    try:
        with at_server_threads():
            pipe(output_type="latent", callback_on_step_end=record, **arguments)
    finally:
        pipe.scheduler = own
    return latents


def assert_each_step_is_the_streamed_one(latents: list[torch.Tensor], trajectories) -> None:
    streamed = torch.stack([trajectory.latents for trajectory in trajectories], dim=1)  # [T + 1, B, ...]
    assert len(latents) == len(streamed) - 1
    for i, x in enumerate(latents):
        assert torch.equal(x, streamed[i + 1]), i


@pytest.fixture
def family() -> str:
    return "flux"


def flux_from_x0(pipeline, scheduler, started, trajectories, **arguments) -> list[torch.Tensor]:
    """FluxPipeline with ``scheduler`` from the streamed x_0 and text states of tiny-flux's 64 x 64,
    4-step rollout (``arguments`` go to the call)."""
    return run_pipeline(
        pipeline,
        scheduler,
        prompt_embeds=positive_env(trajectories, "encoder_hidden_states"),
        pooled_prompt_embeds=positive_env(trajectories, "pooled_projections"),
        latents=torch.stack([trajectory.latents[0] for trajectory in trajectories]),
        height=64,
        width=64,
        num_inference_steps=4,
        guidance_scale=started.resolved.guidance_scale,
        **arguments,
    )


@pytest.mark.parametrize(
    ("solver", "sigmas_argument"),
    [("euler", False), ("euler", True), ("dpmpp_2m", False), ("unipc", False)],
    ids=["euler", "euler-sigmas-argument", "dpmpp_2m", "unipc"],
)
def test_fluxpipeline_with_the_solvers_scheduler_is_the_ode_rollout(
    family_client, family_pipeline, replay_doc, solver, sigmas_argument
):
    """Bitwise at every step: both run the two prompts' rows in one forward on the same inputs (the
    env's text states as prompt_embeds, the streamed x_0, the streamed timesteps fed as t / 1000 in
    float32), and the scheduler's step is the solver's float32 operations in its order
    (test_solvers.py)."""
    started, trajectories = server_ode(family_client, "flux", solver)
    assert list(started.step_solvers) == [solvers.SOLVERS[solver].enum] * 4
    scheduler = replay_doc["SCHEDULERS"][solver]()
    arguments = {}
    if sigmas_argument:  # Euler's own set_timesteps, unshifted: timesteps sigma * 1000, as served
        arguments["sigmas"] = list(started.sigmas)[:-1]
    else:
        scheduler = replay_doc["use_server_schedule"](scheduler, started.sigmas, started.timesteps)
    latents = flux_from_x0(family_pipeline, scheduler, started, trajectories, **arguments)
    assert torch.equal(scheduler.sigmas, torch.tensor(list(started.sigmas)))
    assert torch.equal(scheduler.timesteps, torch.tensor(list(started.timesteps)[:-1]))
    assert_each_step_is_the_streamed_one(latents, trajectories)


def test_the_pages_example_runs_as_written(family_resources):
    """Its rollout (DPM-Solver++(2M), 8 steps at 256 x 256) and its FluxPipeline run, against the
    tiny-flux server: the pipeline's x_T is the streamed one, bitwise (as above)."""
    with at_server_threads():
        ran = run_doc_blocks(2, address=family_resources.server("flux").address)
    assert ran["first"].solver == "dpmpp_2m"
    assert torch.equal(ran["final"], torch.stack([trajectory.latents[-1] for trajectory in ran["run"]]))


def test_dpm_solver_on_its_own_flow_sigmas_is_not_the_rollout(family_client, family_pipeline):
    """The setup replay.md warns against: FluxPipeline's scheduler config with flow sigmas and flow
    prediction makes its own schedule, linspace(1, 1/1000, T + 1) shifted by e^mu, from below 1 and
    with integer timesteps, and ends away from the rollout."""
    started, trajectories = server_ode(family_client, "flux", "dpmpp_2m")
    scheduler = DPMSolverMultistepScheduler.from_config(
        family_pipeline.scheduler.config, use_flow_sigmas=True, prediction_type="flow_prediction"
    )
    latents = flux_from_x0(family_pipeline, scheduler, started, trajectories)
    assert scheduler.sigmas[0] < 1.0 == started.sigmas[0]
    assert scheduler.timesteps.dtype == torch.int64
    final = torch.stack([trajectory.latents[-1] for trajectory in trajectories])
    assert (latents[-1] - final).abs().max() > 100 * TOLERANCE


def test_wanpipeline_with_unipc_is_the_ode_rollout_over_its_integer_timesteps(family_resources, replay_doc):
    """Wan's own solver, UniPC, over its own schedule: sigmas from 1 - 1e-6 and integer timesteps,
    installed as streamed. Bitwise at every step for the reasons of the FLUX test (WanPipeline runs
    the two rows in one forward without CFG, as the server does)."""
    client, pipe = family_resources.client("wan"), family_resources.pipeline("wan")
    started, trajectories = server_ode(client, "wan", None)
    assert list(started.step_solvers) == [rollout_pb2.SOLVER_UNIPC] * 4
    assert started.timesteps[0] == 999.0 and started.sigmas[0] < 1.0
    scheduler = replay_doc["use_server_schedule"](
        replay_doc["SCHEDULERS"]["unipc"](), started.sigmas, started.timesteps
    )
    latents = run_pipeline(
        pipe,
        scheduler,
        prompt_embeds=positive_env(trajectories, "encoder_hidden_states"),
        latents=torch.stack([trajectory.latents[0] for trajectory in trajectories]),
        height=64,
        width=64,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=started.resolved.guidance_scale,
    )
    assert_each_step_is_the_streamed_one(latents, trajectories)
