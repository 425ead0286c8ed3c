"""A service's loops end when cancelled, even when the cancellation meets a wake-up.

On Python 3.11 ``asyncio.wait_for(event.wait(), t)`` swallowed a cancellation that
arrived in the same loop iteration as the event being set (CPython gh-86296): the
peer agent's start loop, flooded with assignments, then ran on after SIGTERM until it
was SIGKILLed. No clock is involved here: the race is set up in one step of the event
loop, and "did it end" is asked after a fixed number of further steps.
"""

import asyncio

import pytest

from irisfed.services.common.runtime import TaskOwner, wait_event, when_woken

STEPS = 20  # event-loop iterations given to a cancelled task to end (it needs two or three)


async def _steps(n: int = STEPS) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_loop_cancelled_as_it_is_woken_ends():
    wake = asyncio.Event()
    steps = []

    async def step():
        steps.append(1)

    task = asyncio.create_task(when_woken("test", step, wake, interval_s=3600))
    await _steps()  # waiting for a wake-up
    wake.set()
    task.cancel()  # the same iteration: the race gh-86296 lost
    await _steps()
    assert task.done(), "the loop lost its cancellation and runs on"
    assert task.cancelled()
    assert steps == []


async def test_wait_event_says_whether_the_event_came_and_passes_a_cancellation_on():
    event = asyncio.Event()
    assert await wait_event(event, 0.001) is False
    event.set()
    assert await wait_event(event, 3600) is True

    event.clear()
    waiting = asyncio.create_task(wait_event(event, 3600))
    await _steps()
    event.set()
    waiting.cancel()
    await _steps()
    assert waiting.cancelled()


async def test_task_owner_close_ends_a_task_that_lost_its_first_cancellation():
    owner = TaskOwner()
    swallowed = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # what a lost cancellation looks like to its owner

    task = owner.spawn(stubborn(), name="stubborn")
    await _steps()
    await owner.close()
    assert swallowed == [1]
    assert task.cancelled()


@pytest.mark.parametrize("iterations", [1, 3])
async def test_task_owner_close_ends_every_task(iterations):
    owner = TaskOwner()
    wake = asyncio.Event()
    tasks = [owner.spawn(when_woken(f"loop-{i}", _steps, wake, interval_s=3600), name=f"loop-{i}")
             for i in range(iterations)]
    await _steps()
    wake.set()
    await owner.close()
    assert all(t.cancelled() for t in tasks)
