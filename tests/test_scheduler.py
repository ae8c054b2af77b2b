"""The scheduler in process: FIFO admission within the bounds, update barriers, parking and drops."""

import asyncio

import pytest
from PIL import Image

from rollout.v1 import rollout_pb2
from rollout_core.tree import Tree
from rollout_server.errors import ForeignRollout, Overloaded, PruneTooLate
from rollout_server.images import ConditionImage
from rollout_server.limits import Limits
from rollout_server.memory import RUNTIME_OVERHEAD, MemoryBudget, RolloutMemory
from rollout_server.scheduler import Outbox, RolloutJob, Scheduler

TIMEOUT = 0.01  # an idle round comes back after this long


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()  # outboxes hand messages to it; it never needs to run here
    yield loop
    loop.close()


def job(loop, samples: int, limit: int = 2, held: int = 0, images: int = 0) -> RolloutJob:
    """A rollout of ``samples`` samples, with ``images`` conditioning images of 2 x 2 RGB pixels."""
    request = rollout_pb2.RolloutRequest(seeds=range(samples))
    outbox = Outbox(loop, wake=lambda: None, limit=limit)
    pixels = [ConditionImage(Image.new("RGB", (2, 2)), rollout_pb2.ConditionImageInfo())] * images
    return RolloutJob(
        request, outbox, submitted_at=0.0, memory=RolloutMemory(held=held), condition_images=pixels
    )


def tree_job(loop, request_id: str) -> RolloutJob:
    """A tree rollout of one root forking in two at step 0 (nodes 0, 1, 2), over 4 steps."""
    tree = Tree.grow([7], [0], [(0, 2)], num_steps=4)
    request = rollout_pb2.RolloutRequest(request_id=request_id, seeds=[7], num_steps=4)
    request.branches.add(step=0, factor=2)
    outbox = Outbox(loop, wake=lambda: None)
    return RolloutJob(request, outbox, submitted_at=0.0, tree=tree)


def test_rollouts_join_in_arrival_order_within_the_running_bound(loop):
    """Bound 4 samples: 2 runs; 3 does not fit and waits, and the 1 behind it waits too (FIFO: a
    large request is never overtaken). Once the 2 ends, both join."""
    scheduler = Scheduler(max_queued=8, max_running_samples=4)
    a, b, c = job(loop, 2), job(loop, 3), job(loop, 1)
    for each in (a, b, c):
        scheduler.submit(each)
    first = scheduler.next_round(TIMEOUT)
    assert first.join == [a] and first.step == [a.key]
    assert scheduler.next_round(TIMEOUT).join == []  # b still does not fit
    scheduler.update({a.key: None})
    second = scheduler.next_round(TIMEOUT)
    assert second.join == [b, c] and second.step == [b.key, c.key]


def test_a_rollout_larger_than_the_bound_runs_alone(loop):
    scheduler = Scheduler(max_queued=8, max_running_samples=4)
    big, small = job(loop, 6), job(loop, 1)
    scheduler.submit(big)
    scheduler.submit(small)
    assert scheduler.next_round(TIMEOUT).join == [big]
    scheduler.update({big.key: None})
    assert scheduler.next_round(TIMEOUT).join == [small]


def test_rollouts_join_while_their_memory_fits_the_budget(loop):
    """Budget 100 bytes above the runtime's overhead: a (holding 60) runs; b (50) does not fit beside
    it and waits, and c (10) behind it waits too, though it would fit. Once a ends, b and c join
    together (60)."""
    budget = MemoryBudget(RUNTIME_OVERHEAD + 100, Limits())
    scheduler = Scheduler(max_queued=8, max_running_samples=64, memory=budget)
    a, b, c = (job(loop, 1, held=held) for held in (60, 50, 10))
    for each in (a, b, c):
        scheduler.submit(each)
    assert scheduler.next_round(TIMEOUT).join == [a]
    assert scheduler.next_round(TIMEOUT).join == []
    scheduler.update({a.key: None})
    assert scheduler.next_round(TIMEOUT).join == [b, c]


def test_admission_is_bounded(loop):
    scheduler = Scheduler(max_queued=2, max_running_samples=64)
    scheduler.submit(job(loop, 1))
    scheduler.submit(job(loop, 1))
    with pytest.raises(Overloaded, match=r"2 rollouts queued or running \(limit 2\)"):
        scheduler.submit(job(loop, 1))
    assert scheduler.in_flight == 2


def test_the_queued_rollouts_images_are_bounded(loop):
    """Bound 24 bytes of pixels, two 12-byte images: a third is refused while two wait, a rollout
    without images is not; once one joins, its images no longer count, and the third is queued."""
    scheduler = Scheduler(max_queued=8, max_running_samples=1, max_image_bytes=24)
    a, b, c = (job(loop, 1, images=1) for _ in range(3))
    scheduler.submit(a)
    scheduler.submit(b)
    assert scheduler.queued_image_bytes == 24
    with pytest.raises(Overloaded, match="hold 24 bytes of conditioning images; this one's 12 would pass"):
        scheduler.submit(c)
    scheduler.submit(job(loop, 1))
    assert scheduler.next_round(TIMEOUT).join == [a]
    assert scheduler.queued_image_bytes == 12
    scheduler.submit(c)


def test_a_cancelled_rollout_frees_its_place_at_once(loop):
    """A closed stream stops counting against --max-queued before the worker's next round drops it,
    whether its rollout was running or still queued."""
    scheduler = Scheduler(max_queued=2, max_running_samples=1)
    running, queued = job(loop, 1), job(loop, 1)
    scheduler.submit(running)
    scheduler.submit(queued)
    assert scheduler.next_round(TIMEOUT).join == [running]  # queued does not fit beside it
    for cancelled in (running, queued):
        cancelled.outbox.close()
        scheduler.submit(job(loop, 1))  # no round in between
    assert scheduler.in_flight == 2


def test_an_update_is_a_barrier(loop):
    """Rollout a runs when the update arrives; b arrives after it. b does not join while a runs; the
    update comes alone once a has finished, and b joins after it."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64)
    a, b = job(loop, 1), job(loop, 1)
    scheduler.submit(a)
    assert scheduler.next_round(TIMEOUT).join == [a]
    done = scheduler.submit_update(object())
    scheduler.submit(b)
    for _ in range(3):
        planned = scheduler.next_round(TIMEOUT)
        assert planned.join == [] and planned.update is None and planned.step == [a.key]
    scheduler.update({a.key: None})
    planned = scheduler.next_round(TIMEOUT)
    assert planned.update is not None and planned.update.done is done
    assert planned.join == [] and planned.step == []
    done.set_result(None)
    assert scheduler.next_round(TIMEOUT).join == [b]


def test_a_side_job_runs_at_the_next_round_without_a_barrier(loop):
    """A side job (a weight-sync join starting or being installed) comes with the next round,
    once: a keeps stepping and b, behind it in the queue, joins in the same round."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64)
    a, b = job(loop, 1), job(loop, 1)
    scheduler.submit(a)
    assert scheduler.next_round(TIMEOUT).join == [a]
    done = scheduler.submit_side_job(object())
    scheduler.submit(b)
    planned = scheduler.next_round(TIMEOUT)
    assert [side.done for side in planned.side_jobs] == [done] and planned.update is None
    assert planned.join == [b] and planned.step == [a.key, b.key]
    assert scheduler.next_round(TIMEOUT).side_jobs == []


def test_a_cancelled_update_frees_its_place_at_once(loop):
    """Two updates wait behind rollout a; the first one's caller leaves (its future is cancelled, as
    a gRPC cancel does). Once a has finished, the second one comes next, not an idle round."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64)
    a = job(loop, 1)
    scheduler.submit(a)
    assert scheduler.next_round(TIMEOUT).join == [a]
    left, waiting = scheduler.submit_update(object()), scheduler.submit_update(object())
    assert left.cancel()
    scheduler.update({a.key: None})
    planned = scheduler.next_round(TIMEOUT)
    assert planned.update is not None and planned.update.done is waiting


def test_a_slow_reader_parks_its_rollout_only(loop):
    """A rollout whose outbox holds ``limit`` unsent messages sits out the rounds (counted) while the
    others step; it steps again once its client takes a message."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64)
    slow, fast = job(loop, 1, limit=2), job(loop, 1, limit=2)
    scheduler.submit(slow)
    scheduler.submit(fast)
    assert scheduler.next_round(TIMEOUT).step == [slow.key, fast.key]
    slow.outbox.put(rollout_pb2.RolloutResponse())
    slow.outbox.put(rollout_pb2.RolloutResponse())
    for _ in range(3):
        assert scheduler.next_round(TIMEOUT).step == [fast.key]
    assert slow.parked_rounds == 3
    scheduler.update({fast.key: None})
    assert scheduler.next_round(TIMEOUT).idle  # only a parked rollout: nothing to do, not counted
    assert slow.parked_rounds == 3
    slow.outbox.taken()
    assert scheduler.next_round(TIMEOUT).step == [slow.key]


def test_ended_streams_are_dropped(loop):
    """A running rollout whose stream ended is dropped in the next round; a queued one never joins."""
    scheduler = Scheduler(max_queued=8, max_running_samples=2)
    running, queued = job(loop, 2), job(loop, 2)
    scheduler.submit(running)
    scheduler.submit(queued)
    assert scheduler.next_round(TIMEOUT).join == [running]
    queued.outbox.close()
    running.outbox.close()
    planned = scheduler.next_round(TIMEOUT)
    assert planned.drop == [running.key] and planned.join == [] and planned.step == []
    assert scheduler.in_flight == 0


def test_a_rollout_held_at_a_prune_point_sits_out_until_its_own_prune(loop):
    """Held after its prune point, a rollout sits out the rounds while another steps; a prune with
    another rollout's control token is refused and releases nothing; its own prune goes to the
    engine in the next round, the rollout stepping in it, the answer left to the engine."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64, prune_hold_seconds=3600.0)
    held, other = tree_job(loop, "held"), tree_job(loop, "other")
    scheduler.submit(held)
    scheduler.submit(other)
    assert scheduler.next_round(TIMEOUT).step == [held.key, other.key]
    scheduler.hold(held.key)
    for _ in range(3):
        assert scheduler.next_round(TIMEOUT).step == [other.key]
    with pytest.raises(ForeignRollout):
        scheduler.prune("held", other.control_token, [1])
    assert held.control_token != other.control_token
    assert scheduler.next_round(TIMEOUT).step == [other.key]
    answer = scheduler.prune("held", held.control_token, [1])
    planned = scheduler.next_round(TIMEOUT)
    assert planned.prune == {held.key: [1]} and planned.answers == {held.key: [answer]}
    assert planned.step == [held.key, other.key] and not answer.done()


def test_a_hold_ends_after_its_bound_and_wakes_the_worker(loop):
    """With nothing else to do, the worker's wait for a round ends when the hold does: the round
    steps the rollout, long before the idle timeout it was given."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64, prune_hold_seconds=TIMEOUT)
    held = tree_job(loop, "held")
    scheduler.submit(held)
    scheduler.next_round(TIMEOUT)
    scheduler.hold(held.key)
    assert scheduler.next_round(timeout=3600.0).step == [held.key]


def test_a_prune_of_a_rollout_that_ends_first_is_answered_too_late(loop):
    """A prune that comes while its rollout takes its last round, or whose stream has ended, applies
    nothing: its caller hears so, and is never left waiting."""
    scheduler = Scheduler(max_queued=8, max_running_samples=64)
    finishing, leaving = tree_job(loop, "finishing"), tree_job(loop, "leaving")
    scheduler.submit(finishing)
    scheduler.submit(leaving)
    scheduler.next_round(TIMEOUT)
    late = scheduler.prune("finishing", finishing.control_token, [1])
    left = scheduler.prune("leaving", leaving.control_token, [2])
    scheduler.update({finishing.key: None})
    leaving.outbox.close()
    assert scheduler.next_round(TIMEOUT).drop == [leaving.key]
    for answer in (late, left):
        with pytest.raises(PruneTooLate):
            answer.result(timeout=0)
