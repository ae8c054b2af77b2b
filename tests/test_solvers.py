"""The deterministic solvers (rollout_core.solvers): each step is its diffusers scheduler's step
bitwise and the published formula's in float64; the sampler keeps their history per row, restarts
it after a stochastic step and regroups it with the rows; on the tiny-flux server the stochastic
steps of a window replay with every solver around them, the deterministic ones regenerate from the
streamed velocities, and a tree's children step on from their fork with their own history. Wan's own
UniPC is in test_family_wan.py; a pipeline with each solver's scheduler against an ODE rollout in
test_replay_diffusers.py."""

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from support.families import family_request
from support.parity import assert_replays
from support.reference import solver_steps
from support.requests import split_events

from rollout.v1 import rollout_pb2
from rollout_client import regenerate_deterministic_steps
from rollout_client.trajectory import collect
from rollout_core import noise, solvers, steps
from rollout_server.families.wan.preset import WAN_SCHEDULER_CONFIG
from rollout_server.sampler import SamplerPlan, advance, init, regroup

# float32's unit roundoff.
U = 2.0**-24
VELOCITY = rollout_pb2.DEBUG_TENSOR_VELOCITY
FLOW = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
# Each solver's diffusers scheduler, configured as the solver states.
SCHEDULERS = {
    "euler": lambda: FlowMatchEulerDiscreteScheduler(),
    "dpmpp_2m": lambda: DPMSolverMultistepScheduler(**FLOW),
    "unipc": lambda: UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG),
}
STEPS = 6


def schedule(kind: str) -> torch.Tensor:
    """Wan's UniPC flow sigmas (just below 1 at the start), or a shifted schedule from 1 as Flux's."""
    if kind == "wan":
        scheduler = UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(STEPS)
    return scheduler.sigmas.to(torch.float32)


def field(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model's velocity: a smooth function of (x, sigma)."""
    return 0.5 * torch.tanh(x) + s * torch.cos(x) - 0.3


def x0() -> torch.Tensor:
    return noise.initial_noise([3, 4], (8, 6))


def our_trajectory(solver: str, sigmas: torch.Tensor, stochastic: list[bool]):
    """Latents x_0 .. x_T and velocities of a run of the sampler, deterministic steps by ``solver``."""
    plan = SamplerPlan(
        sampler_type="FLOW_SDE",
        sigmas=sigmas,
        stochastic=stochastic,
        solver=solver,
        noise_levels=[0.7] * STEPS,
        log_prob_constants=True,
        latent_dtype=torch.float32,
        seeds=[3, 4],
        latent_shape=(8, 6),
        device=torch.device("cpu"),
    )
    state = init(plan)
    latents, velocities, records = [state.x], [], []
    for i in range(STEPS):
        v = field(state.x, sigmas[i])
        records.append(advance(plan, state, v))
        latents.append(state.x)
        velocities.append(v)
    return plan, latents, velocities, records


@pytest.mark.parametrize(
    ("solver", "kind"),
    [("euler", "flux"), ("dpmpp_2m", "flux"), ("dpmpp_2m", "wan"), ("unipc", "wan")],
)
def test_each_solver_steps_as_its_diffusers_scheduler(solver, kind):
    """Every step bitwise the scheduler's ``step`` from the same float32 x_i and v_i: the same float32
    operations in the same order on the same CPU tensors (UniPC's 2 x 2 system through the same
    ``torch.linalg.solve``). The scheduler holds its own history; ours is passed in and out."""
    sigmas = schedule(kind)
    scheduler = SCHEDULERS[solver]()
    scheduler.set_timesteps(STEPS)
    scheduler.sigmas = sigmas.clone()
    scheduler.timesteps = sigmas[:-1] * 1000
    assert solvers.solver_of_scheduler(type(scheduler).__name__, scheduler.config) == solver
    ours = theirs = x0()
    history, orders = solvers.History(), []
    for i, t in enumerate(scheduler.timesteps):
        solved = solvers.solver_step(solver, ours, field(ours, sigmas[i]), sigmas, i, history)
        theirs = scheduler.step(field(theirs, sigmas[i]), t, theirs).prev_sample
        assert torch.equal(solved.x_next, theirs), i
        ours, history = solved.x_next, solved.history
        orders.append(solved.order)
    if solver != "euler":
        # diffusers' warm-up and lower_order_final, as the started event states them.
        assert orders == solvers.step_orders(solver, [False] * STEPS) == [1, 2, 2, 2, 2, 1]
        assert scheduler.lower_order_nums == 2


def test_a_scheduler_with_other_settings_is_served_with_euler():
    """The family default is a solver only where the scheduler's settings are the solver's own."""
    bh1 = UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG, solver_type="bh1")
    third = DPMSolverMultistepScheduler(**FLOW, solver_order=3)
    for scheduler in (bh1, third):
        assert solvers.solver_of_scheduler(type(scheduler).__name__, scheduler.config) == "euler"


@pytest.mark.parametrize("solver", list(solvers.SOLVERS))
@pytest.mark.parametrize("kind", ["flux", "wan"])
@pytest.mark.parametrize(
    "stochastic",
    [[False] * STEPS, [False, True, True, False, False, False], [True, False, True, False, False, True]],
    ids=["ode", "window", "scattered"],
)
def test_each_step_is_the_float64_formula_and_the_stochastic_steps_are_unchanged(solver, kind, stochastic):
    """From the sampler's own x_i and v_i, every deterministic x_{i+1} is the float64 formula's (the
    solver restarting after each stochastic step, s = 1 at the start of the flux schedule), and every
    stochastic step is the first-order Gaussian transition of rollout_core.steps, bitwise.

    Bound: a step combines at most 5 terms, each a float32 coefficient times a tensor of size at most
    M = 2 max(|x_i|, |v_i|) (m_i = x_i - s_i v_i). A coefficient is exp, expm1, log or a quotient of
    sigmas and lambdas = log((1 - s) / s); lambda's absolute error is at most 4 u |lambda|, so h and r
    (lambda differences and their quotient) are within e = 8 u max|lambda| / min h relative, and a
    coefficient (at most 2 of them chained) within 2 e + 4 u. Five terms: 5 (2 e + 4 u) M."""
    sigmas = schedule(kind)
    plan, latents, velocities, records = our_trajectory(solver, sigmas, stochastic)
    expected = solver_steps(
        solver, [x.numpy() for x in latents[:-1]], [v.numpy() for v in velocities], sigmas.numpy(), stochastic
    )
    assert sorted(expected) == [i for i in range(STEPS) if not stochastic[i]]
    size = max(max(x.abs().max().item() for x in latents), max(v.abs().max().item() for v in velocities))
    lambdas = torch.log(1 - sigmas.double()) - torch.log(sigmas.double())
    finite = lambdas[torch.isfinite(lambdas)]
    relative = 8 * U * finite.abs().max().item() / finite.diff().min().item()
    bound = 5 * (2 * relative + 4 * U) * 2 * size
    for i, record in enumerate(records):
        assert record.order == plan.step_orders[i]
        if stochastic[i]:
            mean = steps.transition_mean("FLOW_SDE", latents[i], velocities[i], sigmas, i, 0.7)
            sd = steps.noise_std("FLOW_SDE", sigmas, i, 0.7)
            assert torch.equal(record.x_next, mean + sd * noise.step_noise([3, 4], i, (8, 6)))
        else:
            np.testing.assert_allclose(record.x_next.numpy(), expected[i], atol=bound, rtol=0)


@pytest.mark.parametrize("solver", ["dpmpp_2m", "unipc"])
def test_regrouped_rows_carry_their_own_history(solver):
    """Rows re-formed mid-history (a fork copying row 1 twice, row 0 once) step as the rows they came
    from: each new row's next steps are bitwise its source row's."""
    sigmas = schedule("wan")
    stochastic = [False] * STEPS
    plan, latents, velocities, _ = our_trajectory(solver, sigmas, stochastic)
    state = init(plan)
    for i in range(3):
        advance(plan, state, field(state.x, sigmas[i]))
    regroup(state, [1, 1, 0], [4, 4, 3])
    for i in range(3, STEPS):
        advance(plan, state, field(state.x, sigmas[i]))
    assert torch.equal(state.x, latents[-1][[1, 1, 0]])


# On the tiny-flux server ---------------------------------------------------------------------------


@pytest.fixture
def family() -> str:
    return "flux"


def velocities_of(run) -> torch.Tensor:
    """[B, T, ...]: each sample's streamed velocities (the VELOCITY debug tensors)."""
    return torch.stack([step.debug["velocity"] for step in run.steps], dim=1)


@pytest.mark.parametrize("solver", list(solvers.SOLVERS))
def test_a_stochastic_window_replays_and_the_rest_regenerates_with_each_solver(
    family_client, family_transformer, solver
):
    """FLOW_SDE at steps 1 and 2 of 4 (a window, as MixGRPO samples), the others by ``solver``: the
    stochastic steps replay as ever (their rule and log-prob are the solver's none of business), the
    started event states each step's solver and order, and the client regenerates every
    deterministic step from the streamed x_i and velocities bitwise (the same elementwise float32
    operations on one row as on the rollout's rows)."""
    request = family_request(
        "flux",
        "FLOW_SDE",
        cfg=True,
        stochastic_steps=[1, 2],
        solver=solvers.SOLVERS[solver].enum,
        debug_tensors=[VELOCITY],
    )
    run = split_events(family_client.stream(request))
    started = run.started.message
    enum = solvers.SOLVERS[solver].enum
    unset = rollout_pb2.SOLVER_UNSPECIFIED
    assert list(started.step_solvers) == [enum, unset, unset, enum]
    assert list(started.step_orders) == solvers.step_orders(solver, [False, True, True, False])
    trajectories = run.trajectories()
    assert_replays(family_transformer, trajectories, bare_reference=True)
    velocities = velocities_of(run)
    for trajectory, v in zip(trajectories, velocities, strict=True):
        assert trajectory.solver == solver
        regenerated = regenerate_deterministic_steps(trajectory, v)
        for i in (0, 3):
            assert torch.equal(regenerated[i], trajectory.latents[i + 1]), i


def test_tree_children_step_on_from_their_fork_with_their_own_history(family_client):
    """A fork at stochastic step 1 of 5 with unipc elsewhere: every child starts the solver at step 2
    and is second order, corrector included, at step 3 on its own predictions. Each leaf's
    deterministic steps regenerate bitwise along its path (the parent's x_0 and velocity, then its
    own), so the rows' histories were regrouped with them."""
    request = family_request(
        "flux",
        "FLOW_SDE",
        cfg=False,
        samples_per_prompt=1,
        num_steps=5,
        stochastic_steps=[1],
        branches=[rollout_pb2.Branch(step=1, factor=2)],
        solver=rollout_pb2.SOLVER_UNIPC,
        debug_tensors=[VELOCITY],
    )
    run = split_events(family_client.stream(request))
    assert list(run.started.message.step_orders) == [1, 1, 1, 2, 1]
    trajectories = collect(run.events)
    assert len(trajectories) == 4
    for trajectory in trajectories:
        tree, leaf = trajectory.tree, trajectory.sample_index
        velocities = []
        for i, step in enumerate(run.steps):
            node = tree.owner(leaf, i + 1).id  # the node that took step i on the leaf's path
            velocities.append(step.debug["velocity"][list(step.nodes).index(node)])
        regenerated = regenerate_deterministic_steps(trajectory, torch.stack(velocities))
        for i in (0, 2, 3, 4):
            assert torch.equal(regenerated[i], trajectory.latents[i + 1]), (leaf, i)


def test_server_info_lists_the_solvers_and_the_familys_default(family_client):
    info = family_client.server_info()
    assert list(info.solvers) == [solver.enum for solver in solvers.SOLVERS.values()]
    assert info.defaults.solver == rollout_pb2.SOLVER_EULER  # FluxPipeline's flow-matching Euler
