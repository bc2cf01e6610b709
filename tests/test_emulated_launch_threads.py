"""Issue 35: two host threads launching onto one stream of the emulated
device at once (the CUDA-graph dispatcher's ``gpu<d>:graph`` worker runs a
segment's eager warm-up on the ops' streams while the ``gpu<d>:<stream>``
workers launch the eager ops there). Each thread's launch is its own: its
kernels run in stream order, after the work queued before them, and are
logged under its own op's name (the emulator once kept one launch per
stream: the second thread's kernels went into the first's launch, and those
after its end ran at once on the host, before the stream's queued work)."""
import threading

import numpy as np

from tests.emulated_gpu import DeviceArray, SimulatedRuntime, use_emulated_cupy


def test_two_threads_launching_onto_one_stream_keep_stream_order(host_build_dir, monkeypatch):
    use_emulated_cupy(monkeypatch, host_build_dir)
    rt = SimulatedRuntime(0)
    stream = rt.stream(0, 0)
    x, y, z, w = (np.zeros(4).view(DeviceArray) for _ in range(4))
    # queued on the stream, not run yet: x = 5
    rt.launch(0, stream, lambda: np.add(x, 5.0, out=x), "set_x")
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def op_a():   # y = x + 1, still recording while B launches
        np.add(x, 1.0, out=y)
        a_in.set()
        assert b_in.wait(10)

    def op_b():   # z = x * 2; then, once A's launch has ended, w = x + 3
        assert a_in.wait(10)
        np.multiply(x, 2.0, out=z)
        b_in.set()
        assert a_done.wait(10)
        np.add(x, 3.0, out=w)

    def launch_a():
        rt.launch(0, stream, op_a, "op_a")
        a_done.set()

    threads = [threading.Thread(target=launch_a),
               threading.Thread(target=lambda: rt.launch(0, stream, op_b, "op_b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    rt.sync_streams()
    np.testing.assert_array_equal(np.asarray(y), 6.0)
    np.testing.assert_array_equal(np.asarray(z), 10.0)
    np.testing.assert_array_equal(np.asarray(w), 8.0)   # read x after set_x ran
    assert sorted(rt.log) == ["op_a", "op_b", "set_x"] and rt.log[0] == "set_x"
