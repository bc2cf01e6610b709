"""The scheduling core (runtime/scheduler.py): one rule for every dispatcher
and for the scaling simulator, and the executors behind one interface."""
import threading

import numpy as np

from purine_mpi.graph import Graph
from purine_mpi.runtime.cuda_graph import GraphDispatcher, GraphExecutor
from purine_mpi.runtime.dispatcher import Dispatcher, EventDispatcher, SerialDispatcher
from purine_mpi.runtime.executors import Executor
from purine_mpi.runtime.scheduler import PostingOrder, Schedule
from purine_mpi.runtime.streams_dispatcher import StreamDispatcher
from purine_mpi.tools.scaling.simulate import RankGraph, SimOp, VirtualClock, simulate


def _diamond(tail=frozenset(), cross=None):
    deps = {"a": set(), "b": {"a"}, "c": {"a"}, "d": {"b", "c"}}
    lanes = {"a": "0", "b": "0", "c": "1", "d": "0"}
    priority = {n: (False, i) for i, n in enumerate("abcd")}
    return Schedule(list("abcd"), deps, lanes, priority, (), tail, cross)


def test_ready_counts_and_lanes():
    s = _diamond()
    assert s.start(0) == ["a"]
    assert s.push("a") == "0" and s.pop("0") == "a" and s.pop("0") is None
    ready, milestone = s.complete("a")
    assert sorted(ready) == ["b", "c"] and not milestone
    for n in ready:
        s.push(n)
    assert (s.pop("0"), s.pop("1")) == ("b", "c")
    assert s.complete("b") == ([], False)
    assert s.complete("c") == (["d"], False)
    assert s.waiting() == [] and not s.head_done()
    assert s.complete("d") == ([], True) and s.head_done() and s.tail_done()


def test_the_tail_runs_on_into_the_next_iteration():
    """d is the tail; in the next iteration, b waits for the last d."""
    s = _diamond(tail=frozenset({"d"}), cross={"d": ("b", "d")})
    s.start(0)
    for n in "abc":
        s.complete(n)
    assert s.head_done() and not s.tail_done()  # run() may return: d carries on
    assert s.start(1) == ["a"] and s.carry == {"d"} and s.label("d") == 0
    assert s.complete("a") == (["c"], False)  # b waits for the carried d
    assert s.complete("d") == (["b"], True)   # its own iteration is finished
    assert s.label("b") == 1 and s.head_left == 2


def test_collectives_post_in_seq_order_point_to_point_at_once():
    p = PostingOrder(["c0", "send", "c1"], unordered=["send"])
    posted = []

    def post(n):
        posted.append(n)
        return 0
    p.mark_ready("c1", 0.0)
    p.post_ready(post)
    assert posted == [] and not p.postable()  # c1 waits for c0
    p.mark_ready("send", 1.0)
    p.post_ready(post)
    assert posted == ["send"]
    p.mark_ready("c0", 2.0)
    p.post_ready(post, is_open=lambda n: n != "c1")  # c1's device work not done
    assert posted == ["send", "c0"] and not p.all_posted()
    p.post_ready(post)
    assert posted == ["send", "c0", "c1"] and p.all_posted()


def test_the_simulator_schedules_with_the_core():
    g = RankGraph(0, {"g": SimOp("g", 1.0), "ar": SimOp("ar", 2.0, ("g",), kind="collective"),
                      "u": SimOp("u", 0.5, ("ar",))})
    clock = VirtualClock(g, lambda *a: None)
    assert isinstance(clock.schedule, Schedule) and isinstance(clock.posting, PostingOrder)
    assert simulate([g], 3).period() == 3.5


def test_dispatchers_are_the_core_with_an_executor():
    """No class more than two below the core, no mixin; one interface."""
    for cls in (EventDispatcher, SerialDispatcher, StreamDispatcher, GraphDispatcher):
        below = [c for c in cls.__mro__ if issubclass(c, Dispatcher) and c is not Dispatcher]
        assert len(below) <= 2, cls
        assert all(len(c.__bases__) == 1 for c in cls.__mro__[:-1]), cls
        for name in ("run", "drain", "synchronize", "close", "comm_order", "comm_ready_order",
                     "set_comm_order", "comm_post_latency", "capture_report"):
            assert callable(getattr(cls, name))
    below = [c for c in GraphExecutor.__mro__ if issubclass(c, Executor)]
    assert len(below) <= 3 and all(len(c.__bases__) == 1 for c in GraphExecutor.__mro__[:-1])


def test_the_serial_twin_runs_on_the_calling_thread():
    g = Graph()
    g.add_blob("x", (3,))
    g.add_op("a", "Copy", ["x"], ["y"], thread=0)
    g.add_op("b", "Copy", ["x"], ["z"], thread=1)
    g.add_op("c", "Sum", ["y", "z"], ["w"], thread=2)
    g.infer_shapes()
    with SerialDispatcher(g) as d:
        d.workspace.set("x", np.arange(3.0))
        before = threading.active_count()
        d.run()
        assert d.workers == [] and threading.active_count() == before
        assert d.capture_report() is None and d.comm_post_latency() == {}
        np.testing.assert_array_equal(d.workspace["w"], 2 * np.arange(3.0))
