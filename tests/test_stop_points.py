"""Stop points (flowrl/stop_points.py) and a run's stop (flowrl/train/stopping.py), in one process:
what a stop point does inside and outside a run's scopes, the STOP file, helper threads, waits.
(Real runs stopped in each phase, and two processes: tests/train/test_engine_stop_phases.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from flowrl.distributed import DistContext
from flowrl.stop_points import StopRequested, carried, stop_point, stoppable, wait_for
from flowrl.train.stopping import STOP_FILE, Aborted, RunStop


def quiet_stop(tmp_path) -> tuple[RunStop, list[str]]:
    said: list[str] = []
    return RunStop(tmp_path, DistContext(), said.append), said


def test_outside_a_run_stop_points_do_nothing():
    calls = []
    assert stoppable(lambda x: calls.append(x) or x)(3) == 3 and calls == [3]
    stop_point(), stop_point(every_process=False)
    done: Future = Future()
    done.set_result(7)
    assert wait_for(done) == 7


def test_a_signal_is_announced_and_the_next_stop_point_raises_then_a_second_aborts(tmp_path):
    stop, said = quiet_stop(tmp_path)
    before = signal.getsignal(signal.SIGHUP)
    with stop, stop.iterations():
        stop_point()  # nothing asked yet
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal closed
        assert said == [("SIGHUP: stopping at the next model call; the unfinished iteration is redone on resume "
                         "(Ctrl-C again to abort)")]
        with pytest.raises(Aborted):
            os.kill(os.getpid(), signal.SIGTERM)
        stop_point()
        pytest.fail("the stop point did not stop")
    assert stop.stopped and not stop.state_changed
    assert signal.getsignal(signal.SIGHUP) == before  # the handlers are restored


def test_an_abandoned_evaluation_ends_quietly_and_a_stop_in_the_update_marks_the_state(tmp_path):
    stop, _ = quiet_stop(tmp_path)
    with stop.iterations():
        with stop.evaluation(shared=False):
            stop.handler(signal.SIGINT, None)
            stop_point(every_process=False)  # the evaluation's reward call: this process evaluates alone
            pytest.fail("the evaluation went on")
        assert stop.stopped  # agreed on leaving the evaluation
        with stop.changing_state():
            stop_point()
    assert stop.state_changed


def test_the_stop_file_stops_the_run_once_and_is_removed(tmp_path):
    stop, said = quiet_stop(tmp_path)
    with stop, stop.iterations():
        stop_point()
        (tmp_path / STOP_FILE).touch()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # looked for at most once a second
            stop_point()
            time.sleep(0.05)
    assert stop.stopped and said == [(f"{tmp_path / STOP_FILE} found: stopping at the next model call; "
                                      "the unfinished iteration is redone on resume")]
    assert not (tmp_path / STOP_FILE).exists()


def test_a_helper_thread_stops_at_its_next_point_and_a_wait_for_it_ends(tmp_path):
    stop, _ = quiet_stop(tmp_path)
    started, points = threading.Event(), []

    def helper():
        started.set()
        while True:
            stop_point()
            points.append(1)
            time.sleep(0.01)

    with stop.iterations(), ThreadPoolExecutor(1) as pool:
        future = pool.submit(carried(helper))
        started.wait(5)
        stop.handler(signal.SIGTERM, None)
        begun = time.monotonic()
        wait_for(future)
    assert stop.stopped and time.monotonic() - begun < 2
    assert isinstance(future.exception(), StopRequested)


def test_context_parallel_partners_agree_before_stopping_and_while_waiting(tmp_path, monkeypatch):
    """Two processes that split one data rank's sequences (``context_parallel = 2``, one data
    rank) make every denoiser call together: the main process, which alone reads the STOP file,
    must not stop alone (its partner would wait in a split forward forever). Its stop points and
    waits go through an agreement over every process, not over the (single) data rank."""
    from flowrl import distributed
    from flowrl.train import stopping

    agreements, sums = [], []
    monkeypatch.setattr(stopping.distributed, "any_rank", lambda flag, ctx: agreements.append(flag) or flag)

    def summed(tensor, ctx, every_process=False):
        sums.append(every_process)
        return tensor

    monkeypatch.setattr(stopping.distributed, "all_reduce_sum", summed)
    ctx = distributed.DistContext(rank=0, world_size=1, context_parallel=2, cp_rank=0)
    assert ctx.is_main and not ctx.enabled and ctx.process_count == 2
    stop = RunStop(tmp_path, ctx, None)
    (tmp_path / STOP_FILE).write_text("")
    with pytest.raises(StopRequested):
        stop.check(every_process=True)
    assert agreements == [True], "the main process stopped without its partner"
    assert stop.stopped and stop.abandoned.is_set()  # agreed: helper threads stop too
    pending: Future = Future()
    stop2 = RunStop(tmp_path / "other", ctx, None)
    stop2.requested = True
    with pytest.raises(StopRequested):
        stop2.wait(pending)
    assert sums == [True], "the wait agreed over the data ranks only"


def test_a_stop_asked_of_one_process_reaches_the_others_through_the_store(tmp_path, monkeypatch):
    """The processes of a ddp evaluation forward without agreeing in between, so a stop asked of
    one (the STOP file the main process reads, a signal to one worker) reaches the others through
    the process group's store, at their next look: not when their shares end."""
    from flowrl import distributed
    from flowrl.train import stopping

    class Store:  # the methods of torch's TCPStore that a stop uses
        def __init__(self):
            self.keys = {}

        def set(self, key, value):
            self.keys[key] = value

        def check(self, keys):
            return all(k in self.keys for k in keys)

    store = Store()
    monkeypatch.setattr(distributed, "default_store", lambda: store)
    main = RunStop(tmp_path, DistContext(rank=0, world_size=2), None)
    other = RunStop(tmp_path, DistContext(rank=1, world_size=2), None)
    assert not main.look() and not other.look() and store.keys == {}
    (tmp_path / STOP_FILE).write_text("")
    main._looked = float("-inf")  # the next look is due
    assert main.look() and store.keys == {stopping.STOP_KEY: "1"}
    other._polled = float("-inf")
    assert other.look() and other.requested  # the file it does not read, learnt from the store
    worker = RunStop(tmp_path / "w", DistContext(rank=1, world_size=2), None)
    fresh = Store()
    monkeypatch.setattr(distributed, "default_store", lambda: fresh)
    worker.handler(signal.SIGTERM, None)  # asked of a worker alone: set at its next look, not in the handler
    assert fresh.keys == {} and worker.look() and fresh.keys == {stopping.STOP_KEY: "1"}
