"""EngineTurns (scheduler/engine_turns.py): a chunk takes the engine from a training slice at the
slice's next step, and the two never hold it together."""
import os
import sys
import threading

import pytest

from scheduler.engine_turns import EngineTurns


def slice_thread(turns, used, steps, started):
    """A slice that "trains" until told to stop, recording who holds the engine at each step."""

    def run():
        with turns.slice_turn() as should_stop:
            started.set()
            while not should_stop():
                used.append("slice")
                steps.append(1)
                threading.Event().wait(0.001)
                used.pop()

    return threading.Thread(target=run, daemon=True)


def test_a_chunk_stops_a_running_slice_and_they_never_overlap():
    turns, used, steps, started = EngineTurns(wait_s=30), [], [], threading.Event()
    for _ in range(20):  # slices and chunks back to back: a slice either trains or stops at once
        started.clear()
        t = slice_thread(turns, used, steps, started)
        t.start()
        assert started.wait(timeout=30)
        with turns.chunk_turn():
            assert used == []  # the slice gave the engine back before the chunk touched it
            used.append("chunk")
            used.pop()
        t.join(timeout=30)
        assert not t.is_alive()
    assert steps  # the slices did train between the chunks


def test_a_slice_waiting_behind_a_chunk_trains_after_it_until_the_next_chunk():
    turns, used, steps, started = EngineTurns(wait_s=30), [], [], threading.Event()
    with turns.chunk_turn():
        t = slice_thread(turns, used, steps, started)
        t.start()
        assert not started.wait(timeout=0.2)  # it waits for the engine
    assert started.wait(timeout=30)  # the chunk is done: the slice runs (the flag is down)
    with turns.chunk_turn():
        assert used == []  # it stopped at its next step
    t.join(timeout=30)
    assert not t.is_alive()


def test_a_slice_that_does_not_give_the_engine_back_times_out_the_chunk():
    turns, holding, release = EngineTurns(wait_s=0.2), threading.Event(), threading.Event()

    def stuck():
        with turns.slice_turn():
            holding.set()
            release.wait(timeout=30)  # one "optimizer step" that does not end

    t = threading.Thread(target=stuck, daemon=True)
    t.start()
    assert holding.wait(timeout=30)
    with pytest.raises(TimeoutError, match="did not give the engine back"):
        with turns.chunk_turn():
            pass
    release.set()
    t.join(timeout=30)
    with turns.chunk_turn():  # usable again afterwards
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have their own nice value on Linux only")
def test_a_slice_runs_at_low_cpu_priority_and_a_chunk_lifts_it_back():
    turns, seen, started = EngineTurns(wait_s=30, slice_nice=19), [], threading.Event()
    before = os.getpriority(os.PRIO_PROCESS, 0)

    def run():
        tid = threading.get_native_id()
        with turns.slice_turn() as should_stop:
            seen.append(os.getpriority(os.PRIO_PROCESS, tid))
            started.set()
            while not should_stop():
                threading.Event().wait(0.001)
            seen.append(os.getpriority(os.PRIO_PROCESS, tid))  # after the chunk raised the flag
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(timeout=30)
    with turns.chunk_turn():
        pass
    t.join(timeout=30)
    assert seen[0] == 19
    if can_raise_priority():
        assert seen[1:] == [before, before]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the calling thread was never touched


def can_raise_priority() -> bool:
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - os.getpriority(os.PRIO_PROCESS, 0)
