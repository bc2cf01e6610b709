"""A failed capture always ends cleanly (issue 35, item 1), and no capturable
claim that CuPy refuses (item 5), on the project's own ``CudaRuntime`` over
the emulated CuPy (tests/emulated_gpu).

Any CUDA error inside a capture invalidates it: CuPy's ``is_capturing``
then raises, the capture stays open until ``end_capture`` ends it (which
raises too), and an ``Event.done`` query on a captured event returns False
and invalidates the capture. ``CudaRuntime.abort_capture`` must end such a
capture, so that the stream runs the segment eagerly, said once.
"""
import numpy as np
import pytest

import purine_mpi.gpu as gpu
from purine_mpi.graph import Graph
from purine_mpi.graph.core import Location
from purine_mpi.ops.registry import OpKernel, register
from purine_mpi.runtime.cuda_runtime import CudaRuntime
from purine_mpi.runtime.factory import make_dispatcher
from tests.emulated_gpu import CUDARuntimeError, SimulatedRuntime, on_device
from tests.emulated_gpu.device import INVALIDATED


def _add_one(x):
    np.add(x, np.float32(1), out=x)


@pytest.mark.parametrize("error", ["event done", "stream synchronize"])
def test_an_invalidated_capture_is_ended_and_its_stream_runs_eagerly(emulated, error):
    rt = SimulatedRuntime(0)
    assert isinstance(rt, CudaRuntime)
    x = on_device([1.0, 2.0])
    origin = rt.stream(0, "capture")
    rt.begin_capture(0, origin)

    def invalidating():
        _add_one(x)
        if error == "event done":   # CuPy 14.2: False, and the capture is invalidated
            assert rt.query(rt.record(0, origin)) is False
        else:
            with pytest.raises(CUDARuntimeError):
                origin.synchronize()

    if error == "event done":   # the add was recorded before the event: then invalidated
        rt.launch(0, origin, invalidating, "op")
    else:   # the add is queued after the failed sync: its launch fails
        with pytest.raises(CUDARuntimeError, match="Invalidated"):
            rt.launch(0, origin, invalidating, "op")
    with pytest.raises(CUDARuntimeError, match=INVALIDATED.split(":")[0]):
        origin.is_capturing()   # as CuPy's streamIsCapturing on an invalidated capture
    rt.abort_capture(0, origin)
    assert origin.is_capturing() is False   # ended: the stream is usable again
    rt.launch(0, origin, lambda: _add_one(x), "eager")
    rt.sync_streams()
    np.testing.assert_array_equal(np.asarray(x), [2.0, 3.0])   # the captured add never ran
    assert rt.graphs == []


def test_ending_an_invalidated_capture_raises_and_ends_it(emulated):
    """What ``abort_capture`` relies on: end_capture on an invalidated
    capture raises and leaves no stream of the capture capturing."""
    rt = SimulatedRuntime(0)
    origin, side = rt.stream(0, "capture"), rt.stream(0, "side")
    rt.begin_capture(0, origin)
    rt.wait(side, rt.record(0, origin))   # side joins the capture
    assert side.is_capturing()
    rt.query(rt.record(0, side))          # invalidates it
    with pytest.raises(CUDARuntimeError, match="Invalidated"):
        origin.end_capture()
    assert not origin.is_capturing() and not side.is_capturing()


@register
class _PollsItsOwnEvent(OpKernel):
    """y = x + 1, then a poll of an event it records on its stream: eagerly
    harmless; in a capture it invalidates the capture (CuPy returns False)."""

    op_type = "TestAbortPollingOp"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        np.add(ins[0], np.float32(1), out=outs[0])
        cuda = gpu.import_cupy().cuda
        event = cuda.Event(disable_timing=True)
        event.record(cuda.get_current_stream())
        event.done   # noqa: B018  (the query is the point)


@register
class _Double(OpKernel):
    op_type = "TestAbortDouble"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        np.multiply(ins[0], np.float32(2), out=outs[0])


def _graph():
    g = Graph("abort")
    g.add_blob("a", (3,), dtype="float32", location=Location(0, 0))
    g.add_op("double", "TestAbortDouble", ["a"], ["b"], location=Location(0, 0), thread=0)
    g.add_op("poll", "TestAbortPollingOp", ["b"], ["c"], location=Location(0, 0), thread=0)
    g.infer_shapes().validate()
    return g


def test_a_segment_whose_capture_is_invalidated_runs_eagerly_said_once(emulated):
    """Through the CUDA-graph dispatcher: the capture of the segment fails
    (its op's event query invalidates it), the capture is ended, and the
    segment runs eagerly on the same streams, every iteration right; the
    log says why once. Before the fix the capture was left open: the next
    use of its stream failed."""
    rt = SimulatedRuntime(1)
    notes = []
    d = make_dispatcher(_graph(), runtime=rt, cuda_graph=True, log=notes.append)
    try:
        for it in range(4):
            a = np.arange(3, dtype=np.float32) + it
            d.workspace.set("a", a)
            d.run(it)
            np.testing.assert_array_equal(np.asarray(d.workspace["c"]), 2 * a + 1)
    finally:
        d.close()
    failed = [n for n in notes if "could not capture" in n]
    assert len(failed) == 1 and "runs eagerly" in failed[0], notes
    assert "Invalidated" in failed[0]
    assert rt.graphs == []
    assert not any(s.capture is not None for s in rt.device.streams)


# ------------------------------------------ item 5: a pinned Copy in a capture

def _copy_graph():
    g = Graph("pinned_copy")
    g.add_blob("h", (3,), dtype="float32", location=Location(0, -1))
    g.blobs["h"].attrs["pinned"] = True
    g.add_op("upload", "Copy", ["h"], ["d"], location=Location(0, 0), thread=0)
    g.blobs["d"].location = Location(0, 0)
    g.add_op("double", "TestAbortDouble", ["d"], ["e"], location=Location(0, 0), thread=0)
    g.infer_shapes().validate()
    return g


def test_a_pinned_copy_is_captured_as_cudamemcpyasync_and_replays_new_data(emulated):
    """capture_blocker calls a pinned host-to-device Copy capturable; so it
    must be: the Copy the dispatcher runs is one cudaMemcpyAsync, recorded
    into the graph, which copies what the pinned buffer holds at each
    replay. (It was CuPy's ndarray.set, which CuPy refuses in any capture:
    the segment always fell back to eager.)"""
    rt = SimulatedRuntime(2)
    notes = []
    d = make_dispatcher(_copy_graph(), runtime=rt, cuda_graph=True, log=notes.append)
    try:
        assert d.executor.report()["eager_gpu_ops"] == {}
        for it in range(4):
            h = np.arange(3, dtype=np.float32) * (it + 1)
            d.workspace["h"][...] = h
            d.run(it)
            np.testing.assert_array_equal(np.asarray(d.workspace["e"]), 2 * h)
    finally:
        d.close()
    assert not [n for n in notes if "could not capture" in n], notes
    assert rt.graphs and "upload" in rt.graphs[-1].names()
    assert rt.graphs[-1].launches >= 2


def test_a_copy_through_ndarray_set_is_named_eager():
    """The plain Copy kernel (CuPy's ndarray.set) is not capturable: the
    blocker names it, where it used to call every pinned Copy capturable."""
    from purine_mpi.ops.catalog import get_kernel_class
    from purine_mpi.runtime.cuda_runtime import HostDeviceCopy
    from purine_mpi.runtime.segments import capture_blocker
    g = _copy_graph()
    op = g.ops["upload"]
    plain = get_kernel_class("Copy")(op)
    assert "ndarray.set" in capture_blocker(g, op, plain)
    assert capture_blocker(g, op, HostDeviceCopy(op)) is None
