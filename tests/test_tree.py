"""Tree rollouts on a real server: every edge replays through the trainer's replay, children draw the
noise of the documented rule, a tree of factors 1 is the flat rollout bitwise, siblings share their
prefix bitwise (on the wire once, in memory once), the transformer rows are the tree's formula, and
PruneRollout stops nodes at a step boundary without touching anything else."""

import itertools

import grpc
import pytest
import torch
from support.errors import field_violations, grpcurl, grpcurl_exit, health_status
from support.families import family_request
from support.parity import TOLERANCE, assert_replays
from support.requests import HOLDING_OPTIONS, collected, split_events
from support.servers import start_server

from rollout.v1 import rollout_pb2
from rollout_client import RolloutClient, grpo
from rollout_client.events import Image, Pruned, Step
from rollout_client.trajectory import Trajectory
from rollout_core import noise

EPS = rollout_pb2.DEBUG_TENSOR_EPS
MASK64 = (1 << 64) - 1


def branches(*points) -> list[rollout_pb2.Branch]:
    """Branch points from (step, factor) or (step, factor, noise_level) tuples."""
    return [
        rollout_pb2.Branch(step=p[0], factor=p[1], noise_level=p[2] if len(p) > 2 else None) for p in points
    ]


def tree_request(sampler="FLOW_SDE", cfg=False, **fields) -> rollout_pb2.RolloutRequest:
    """Two prompts, one root each, 5 steps, forks at steps 0 (x2) and 2 (x3, at its own noise level)."""
    tree = {"samples_per_prompt": 1, "num_steps": 5, "branches": branches((0, 2), (2, 3, 0.9))}
    return family_request("flux", sampler, cfg, **{**tree, **fields})


def splitmix64(value: int) -> int:
    """SplitMix64, written out from its definition (Steele, Lea and Flood, 2014)."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def documented_child_seed(parent: int, step: int, child: int) -> int:
    """The child-seed rule as docs/protocol.md states it."""
    return parent if child == 0 else splitmix64(parent ^ splitmix64(2**63 + step * 2**32 + child))


def replaced(request: rollout_pb2.RolloutRequest, **fields) -> rollout_pb2.RolloutRequest:
    """A copy of ``request`` with ``fields`` set anew."""
    copy = rollout_pb2.RolloutRequest()
    copy.CopyFrom(request)
    for name, value in fields.items():
        copy.ClearField(name)
        if isinstance(value, list):
            getattr(copy, name).extend(value)
        else:
            setattr(copy, name, value)
    return copy


@pytest.mark.parametrize("cfg", [False, True], ids=["cfg-off", "cfg-on"])
@pytest.mark.parametrize("sampler", ["FLOW_SDE", "DANCE", "CPS"])
def test_every_edge_of_a_tree_replays(client, tiny_transformer, sampler, cfg):
    leaves = client.rollout(tree_request(sampler, cfg))
    assert len(leaves) == 2 * 2 * 3
    assert_replays(tiny_transformer, leaves, bare_reference=True)
    # The trainer's unit: each edge once, scored on a leaf below it.
    edges = grpo.tree_edges(leaves)
    tree = leaves[0].tree
    stochastic = leaves[0].stochastic.tolist()
    assert len(edges) == sum(stochastic[i] for _, i in tree.edges())
    for edge in edges:
        streamed = leaves[edge.row].log_probs[edge.step]
        replayed = grpo.step_log_probs(tiny_transformer, [leaves[edge.row]], edge.step)
        assert abs(replayed.item() - streamed.item()) <= TOLERANCE, edge
    # Step 2 is scored under its branch's own noise level.
    assert [leaf.noise_level_at(2) for leaf in leaves] == [pytest.approx(0.9)] * len(leaves)


def test_children_draw_the_noise_of_the_documented_rule(client):
    rollout = split_events(client.stream(tree_request(debug_tensors=[EPS])))
    message = rollout.started.message
    shape = tuple(message.layout.shape)
    nodes = {node.id: node for node in message.tree}
    for node in message.tree:
        if node.parent != -1:
            parent = nodes[node.parent]
            child = [n.id for n in message.tree if n.parent == node.parent].index(node.id)
            assert node.seed == documented_child_seed(parent.seed, node.start_step, child)
    roots = [node for node in message.tree if node.parent == -1]
    assert [root.seed for root in roots] == list(message.seeds)
    assert torch.equal(rollout.started.x0, noise.initial_noise(message.seeds, shape))
    for step in rollout.steps:
        seeds = [nodes[n].seed for n in step.nodes]
        generator = torch.Generator("cpu")
        for row, seed in enumerate(seeds):
            generator.manual_seed(splitmix64(seed ^ splitmix64(step.index + 1)))
            expected = torch.randn(shape, generator=generator, dtype=torch.float32)
            assert torch.equal(step.debug["eps"][row], expected), (step.index, step.nodes[row])


def test_a_tree_of_factors_one_is_the_flat_rollout_bitwise(client):
    ones = split_events(client.stream(tree_request(branches=branches((0, 1), (2, 1)), debug_tensors=[EPS])))
    flat = split_events(client.stream(tree_request(branches=[], debug_tensors=[EPS])))
    assert torch.equal(ones.started.x0, flat.started.x0)
    for a, b in zip(ones.steps, flat.steps, strict=True):
        assert a.nodes == [0, 1] and b.nodes == []
        assert torch.equal(a.x_next, b.x_next)
        assert torch.equal(a.debug["eps"], b.debug["eps"]) and torch.equal(a.log_probs, b.log_probs)
    for a, b in zip(ones.trajectories(), flat.trajectories(), strict=True):
        assert torch.equal(a.latents.stack(), b.latents)
        torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=0, equal_nan=True)


def test_siblings_share_their_prefix_on_the_wire_and_in_memory(client, tmp_path):
    rollout = split_events(client.stream(tree_request(images=True)))
    tree = rollout.trajectories()[0].tree
    # Each step event has one row per node that takes the step: every latent travels once.
    for step in rollout.steps:
        takers = [node.id for node in tree.nodes if node.start_step <= step.index < node.end_step]
        assert step.nodes == takers and step.x_next.shape[0] == len(takers)
    assert rollout.started.x0.shape[0] == len(tree.roots)
    leaves = rollout.trajectories()
    by_id = {leaf.sample_index: leaf for leaf in leaves}
    assert sorted(by_id) == [node.id for node in tree.leaves]
    assert sorted(image.sample_index for image in rollout.images) == sorted(by_id)
    for node in tree.nodes:
        if node.depth == 0 or node.is_leaf:
            continue
        first, *others = [by_id[leaf.id] for leaf in tree.leaves_under(node.id)]
        for other in others:
            for j in range(node.end_step + 1):  # up to the fork below this node: bitwise, one buffer
                assert torch.equal(first.latents[j], other.latents[j])
                assert first.latents[j].data_ptr() == other.latents[j].data_ptr()
            assert first.node_path[: node.depth + 1] == other.node_path[: node.depth + 1]
    siblings = [by_id[leaf.id] for leaf in tree.leaves_under(tree.leaves[0].parent)]
    fork = tree.leaves[0].start_step
    assert not torch.equal(siblings[0].latents[fork + 1], siblings[1].latents[fork + 1])
    assert siblings[0].log_probs[fork] != siblings[1].log_probs[fork]
    # A leaf saves and loads as a whole trajectory.
    siblings[1].save(tmp_path / "leaf.safetensors")
    loaded = Trajectory.load(tmp_path / "leaf.safetensors")
    assert torch.equal(loaded.latents, siblings[1].latents.stack())
    assert loaded.node_path == siblings[1].node_path and loaded.noise_levels == siblings[1].noise_levels


def expected_rows(samples: int, forks: dict[int, int], num_steps: int, cfg_branches: int) -> int:
    """Rows of a tree rollout, counted step by step: the forward of step i runs once per distinct x_i."""
    width, rows = samples, 0
    for i in range(num_steps):
        rows += width * cfg_branches  # the nodes holding x_i; a fork at i comes after this forward
        width *= forks.get(i, 1)
    return rows


@pytest.mark.parametrize("cfg", [False, True], ids=["cfg-off", "cfg-on"])
def test_the_server_reports_the_rows_of_the_tree(client, cfg):
    forks = {0: 2, 3: 2, 6: 2, 9: 2}  # BranchGRPO's layout, at 20 steps
    request = family_request(
        "flux",
        "FLOW_SDE",
        cfg,
        prompts=["a red fox"],
        samples_per_prompt=1,
        num_steps=20,
        latents=rollout_pb2.LATENT_SELECTION_NONE,
        branches=branches(*forks.items()),
    )
    finished = split_events(client.stream(request)).finished.message
    cfg_branches = 2 if cfg else 1
    assert finished.transformer_rows == expected_rows(1, forks, 20, cfg_branches) == 203 * cfg_branches
    flat = split_events(client.stream(replaced(request, branches=[], samples_per_prompt=16)))
    assert flat.finished.message.transformer_rows == 320 * cfg_branches


@pytest.mark.parametrize(
    "points, field",
    [
        ([(5, 2)], "branches[0].step"),  # num_steps is 5
        ([(2, 2), (2, 2)], "branches[1].step"),
        ([(3, 2), (1, 2)], "branches[1].step"),
        ([(1, 0)], "branches[0].factor"),
        ([(1, 2, 5.0)], "branches[0].noise_level"),
        ([(0, 64), (1, 2)], "branches"),  # 2 roots x 128 leaves: above --max-running-samples
        ([(0, 8), (1, 8), (2, 8), (3, 8)], "branches"),  # above the node limit too
    ],
)
def test_bad_branches_are_refused_naming_the_field(client, points, field):
    with pytest.raises(grpc.RpcError) as raised:
        client.rollout(tree_request(branches=branches(*points)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in [violation.field for violation in field_violations(raised.value)]
    assert health_status(client.channel) == 1  # SERVING


def test_a_fork_at_a_step_without_noise_is_refused(client):
    ode = tree_request(sampler="ODE", branches=branches((1, 2)))
    listed = tree_request(stochastic_steps=[0, 1], branches=branches((3, 2)))
    cps_last = tree_request(sampler="CPS", branches=branches((4, 2)))  # CPS into sigma = 0
    for request in (ode, listed, cps_last):
        with pytest.raises(grpc.RpcError) as raised:
            client.rollout(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in field_violations(raised.value)] == ["branches[0].step"]


def test_server_info_lists_trees(client):
    info = client.server_info()
    assert "tree" in info.features and info.limits.max_tree_nodes == 1024
    assert "prune_points" in info.features and info.limits.prune_hold_seconds == 10


# Pruning -------------------------------------------------------------------------------------------

# A tree that the client prunes when step 1 arrives: the rollout is held there (its prune point) until
# the prune comes, so the prune lands at step 2 however fast the server runs.
PRUNED_TREE = {
    "samples_per_prompt": 1,
    "num_steps": 6,
    "branches": branches((1, 2), (3, 2)),
    "debug_tensors": [EPS],
    "prune_points": [1],
}


@pytest.fixture(scope="module")
def solo_client(tiny_flux_folder, cache_dir, tmp_path_factory):
    """A server that runs every row in a forward of its own (--max-batch-size 1): a row's numbers do
    not depend on how many rows step with it, not even through the model's float rounding. It holds
    a rollout at a prune point for as long as any test takes to answer."""
    log = tmp_path_factory.mktemp("tree") / "solo.log"
    server = start_server(cache_dir, log, "--max-batch-size", "1", "--prune-hold-seconds", "3600")
    with RolloutClient(server.address, timeout=300) as solo:
        yield solo
    assert server.stop() == 0


def stream_pruned(source: RolloutClient, request, at_step: int, nodes: list[int]):
    """The events of ``request``, pruning ``nodes`` when step ``at_step`` arrives; and the answer."""
    events, answer = [], None
    for event in source.stream(request):
        events.append(event)
        if isinstance(event, Step) and event.index == at_step:
            answer = source.prune(events[0], nodes)
    return events, answer


@pytest.mark.parametrize("batched", [False, True], ids=["solo-forwards", "batched-forwards"])
def test_pruned_nodes_take_no_more_steps_and_the_others_are_unchanged(solo_client, client, batched):
    """On a server whose forwards hold one row each, the rows left after a prune are bitwise what they
    are without it. With batching on, their latents may differ by the model's float rounding at the
    smaller batch size (within the batching tolerance); eps and log-probs stay bitwise. The prune
    lands at the step after the prune point, as its answer says."""
    source = client if batched else solo_client
    request = tree_request(request_id=f"prune-{batched}", **PRUNED_TREE)
    full = split_events(source.stream(replaced(request, request_id="whole", prune_points=[])))
    events, answer = stream_pruned(source, request, at_step=1, nodes=[2])
    tree = full.trajectories()[0].tree
    below = sorted(node.id for node in tree.descendants(2))
    assert list(answer.nodes) == below and answer.step == 2
    (pruned,) = [event for event in events if isinstance(event, Pruned)]
    assert pruned.nodes == below and pruned.step == 2
    steps = [event for event in events if isinstance(event, Step)]
    full_steps = {step.index: step for step in full.steps}
    assert sorted(full_steps) == [step.index for step in steps]
    for step in steps:
        if step.index >= pruned.step:
            assert not set(step.nodes) & set(below), step.index
        whole = full_steps[step.index]
        rows = [whole.nodes.index(node) for node in step.nodes]
        assert torch.equal(step.debug["eps"], whole.debug["eps"][rows])
        assert torch.equal(step.log_probs, whole.log_probs[rows])
        if batched:
            torch.testing.assert_close(step.x_next, whole.x_next[rows], atol=TOLERANCE, rtol=0)
        else:
            assert torch.equal(step.x_next, whole.x_next[rows]), step.index
    leaves = collected(events).trajectories()
    assert sorted(leaf.sample_index for leaf in leaves) == [
        leaf.id for leaf in tree.leaves if leaf.id not in below
    ]


def test_pruning_every_leaf_ends_the_rollout_with_ok(client):
    request = tree_request(request_id="prune-all", images=True, **{**PRUNED_TREE, "prune_points": [0]})
    events, answer = stream_pruned(client, request, at_step=0, nodes=[0, 1])
    assert answer.step == 1 and len(answer.nodes) == len(events[0].message.tree)
    kinds = [type(event).__name__ for event in events]
    assert kinds == ["Started", "Step", "Pruned", "Finished"]
    assert events[-1].message.transformer_rows == 2  # step 0's forward of the two roots


def test_a_held_rollout_waits_for_its_caller_while_another_runs_whole(solo_client):
    """Held after its prune point, a rollout takes no step however long its caller takes (here: a
    whole other rollout); the other rollout is not held up. Its caller's "no prune" releases it."""
    held = tree_request(request_id="held", **PRUNED_TREE)
    stream = solo_client.stream(held)
    started = next(stream)
    assert [event.index for event in itertools.islice(stream, 2)] == [0, 1]
    other = split_events(solo_client.stream(tree_request(request_id="other", num_steps=6)))
    assert [step.index for step in other.steps] == list(range(6))
    answer = solo_client.prune(started)  # the explicit "no prune"
    assert list(answer.nodes) == [] and answer.step == 2
    rest = list(stream)
    assert [event.index for event in rest if isinstance(event, Step)] == [2, 3, 4, 5]
    assert not any(isinstance(event, Pruned) for event in rest)


def test_a_prune_after_the_last_step_is_too_late(server):
    """Once the last step has been taken, a prune stops nothing and says so, and no pruned event
    comes. The rollout is still there: it has 64 images to decode, and with a fixed stream window it
    parks a few messages ahead of a reader that stops."""
    request = tree_request(request_id="late", images=True, branches=branches((0, 4), (2, 8)))
    with RolloutClient(server.address, timeout=300, channel_options=HOLDING_OPTIONS) as reader:
        stream = reader.stream(request)
        started = next(stream)
        for event in stream:
            if isinstance(event, Step) and event.index == request.num_steps - 1:
                break
        with pytest.raises(grpc.RpcError) as raised:
            reader.prune(started, [2])
        rest = list(stream)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has taken its last step" in raised.value.details()
    assert not any(isinstance(event, Pruned) for event in rest)
    assert sum(isinstance(event, Image) for event in rest) == 2 * 4 * 8  # every leaf's image


def test_only_the_rollouts_caller_can_prune_it(client, server):
    """Another connection that knows the request id, without the rollout's control token or with
    another rollout's, is refused and stops nothing; each rollout has a token of its own."""
    with RolloutClient(server.address, timeout=300) as stranger:
        mine = client.stream(tree_request(request_id="mine", **PRUNED_TREE))
        started = next(mine)
        assert [event.index for event in itertools.islice(mine, 2)] == [0, 1]  # held after step 1
        theirs = next(stranger.stream(tree_request(request_id="theirs", **PRUNED_TREE)))
        for forged in ("", theirs.message.control_token, started.message.control_token[:-1]):
            prune = rollout_pb2.PruneRolloutRequest(request_id="mine", nodes=[2], control_token=forged)
            with pytest.raises(grpc.RpcError) as raised:
                stranger.stub.PruneRollout(prune)
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        tokens = {started.message.control_token, theirs.message.control_token}
        answer = client.prune(started, [2])
        assert answer.step == 2
        events = list(mine)
    (pruned,) = [event for event in events if isinstance(event, Pruned)]
    assert pruned.step == 2  # the forged prunes did not release the hold, the real one did
    assert len(tokens) == 2 and all(len(token) == 43 for token in tokens)  # 256 bits, URL-safe base64


def test_prune_refusals_name_what_is_wrong(client, server):
    stub = client.stub
    with pytest.raises(grpc.RpcError) as raised:
        stub.PruneRollout(rollout_pb2.PruneRolloutRequest(request_id="no-such-rollout", nodes=[0]))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    result = grpcurl(
        server.address, "rollout.v1.RolloutService/PruneRollout", data={"requestId": "none", "nodes": [1]}
    )
    assert result.returncode == grpcurl_exit(grpc.StatusCode.NOT_FOUND), result.stderr

    def refusal(request_id: str, nodes: list[int], request: rollout_pb2.RolloutRequest) -> grpc.RpcError:
        """The error of a prune sent once the rollout ``request`` has taken its first step."""
        stream = client.stream(replaced(request, request_id=request_id))
        started = next(stream)
        for event in stream:
            if isinstance(event, Step):
                with pytest.raises(grpc.RpcError) as raised:
                    client.prune(started, nodes)
                return raised.value  # closes the stream
        raise AssertionError("the rollout took no step")

    tree = tree_request(**PRUNED_TREE)
    unknown = refusal("unknown-node", [1, 999], tree)
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in field_violations(unknown)] == ["nodes[1]"]
    flat = refusal("flat", [0], replaced(tree, branches=[], prune_points=[]))
    assert [v.field for v in field_violations(flat)] == ["request_id"]
    assert health_status(client.channel) == 1


@pytest.mark.parametrize(
    "points, fields, field",
    [
        ([5], {}, "prune_points[0]"),  # num_steps is 6: no step follows 5
        ([1, 1], {}, "prune_points[1]"),
        ([3, 2], {}, "prune_points[1]"),
        ([1], {"branches": []}, "prune_points"),  # a flat rollout has nothing to prune
        (range(101), {}, "prune_points"),  # counted before any is read
    ],
)
def test_bad_prune_points_are_refused_naming_the_field(client, points, fields, field):
    with pytest.raises(grpc.RpcError) as raised:
        client.rollout(tree_request(**{**PRUNED_TREE, "prune_points": list(points), **fields}))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [violation.field for violation in field_violations(raised.value)] == [field]
