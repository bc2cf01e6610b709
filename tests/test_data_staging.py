"""The data reader on a GPU: the prefetch thread stages each batch in one of
two page-locked buffers; the op's host work (``before_iteration``) takes the
ready one, its device work (``run``) is the cudaMemcpyAsync of it on the copy
stream, which a CUDA graph can capture (ops/data.py). Tested on the emulated
device (NumPy-backed CuPy) and the simulated stream runtime, whose queued
work runs only when the host synchronises or polls -- a copy stays in flight
as long as nothing waits for it."""
import threading

import numpy as np
import pytest

from purine_mpi import gpu
import purine_mpi.gpu.streams  # noqa: F401  (gpu.streams)
from purine_mpi.parallel import placement
from purine_mpi.graph.core import Op
from purine_mpi.ops.data import DataReader
from tests.emulated_gpu import DeviceArray, SimulatedRuntime, tiny_config, train_simulated

SOURCE = {"source": "synthetic", "shape": [2, 3, 3], "classes": 4, "num_samples": 10,
          "shuffle": True}


def _reader(batch=4):
    attrs = {"source": SOURCE, "batch_size": batch, "seed": 3}
    (dshape, ddtype), (lshape, ldtype) = DataReader.infer(attrs, [])
    k = DataReader(Op("data", "DataReader", [], ["data", "label"], attrs))

    def outs():
        return [np.full(dshape, np.nan, ddtype).view(DeviceArray),
                np.full(lshape, -1, ldtype).view(DeviceArray)]
    return k, outs


def _deliver(iters, wait=True):
    """Run the reader ``iters`` times on the simulated copy stream without
    letting the device run in between (a slow copy stream: every copy stays
    queued until the prefetch thread or the final drain makes it run), each
    run into fresh outputs; returns them after the drain, and the staging
    writes as (pair, thread)."""
    rt = SimulatedRuntime(0)
    stream = rt.stream(0, "h2d")
    k, outs = _reader()
    writes = []
    real_stage = k._stage

    def stage(pair, batch):
        result = real_stage(pair, batch)
        writes.append((pair, threading.current_thread().name))
        return result
    k._stage = stage
    k.ins, k.outs = [], outs()
    k.setup(k.ins, k.outs)
    run_rt = rt
    if not wait:  # the mutation: refill a pair without waiting for its copy
        class NoWait:
            launch, record = rt.launch, rt.record

            def sync_event(self, event):
                pass
        run_rt = NoWait()
    delivered = []
    for t in range(iters):
        k.outs = outs()
        delivered.append(k.outs)
        assert k.before_iteration(t, None) == t % 2  # the pair: the capture's key
        run_rt.launch(0, stream, lambda o=k.outs: k.run(k.ins, o), "data")
        k.after_launch(run_rt.record(0, stream), run_rt)
    rt.sync_streams()
    k._take(k.position)  # let the last prefetch finish
    return k, delivered, writes, rt


def _expected(iters):
    ref, _ = _reader()
    return [ref.prepare(t) for t in range(iters)]


def test_a_staging_buffer_is_never_refilled_while_a_copy_reads_it(emulated):
    iters = 7
    k, delivered, writes, rt = _deliver(iters)
    for t, ((data, label), (want_d, want_l)) in enumerate(zip(delivered, _expected(iters))):
        np.testing.assert_array_equal(np.asarray(data), want_d, err_msg=f"batch {t}")
        np.testing.assert_array_equal(np.asarray(label), want_l, err_msg=f"batch {t}")
    # double buffering: the pairs alternate, every write in the prefetch thread
    assert [p for p, _ in writes] == [t % 2 for t in range(iters + 1)]
    assert all(name.startswith("prefetch:") for _, name in writes)
    # the refill of a pair waited on its copy's event (synchronised, not polled)
    assert sum(1 for c in rt.calls if c[0] == "sync_event") == iters - 1


def test_without_the_wait_a_queued_copy_reads_the_next_batch(emulated):
    """The mutation the test above catches: refilling a pair without waiting
    for the copy that reads it delivers a later batch of that pair."""
    iters = 5
    _, delivered, _, _ = _deliver(iters, wait=False)
    expected = _expected(iters + 2)
    wrong = [t for t in range(iters - 1)
             if not np.array_equal(np.asarray(delivered[t][0]), expected[t][0])]
    assert wrong, "every batch arrived intact without the wait"
    # the copies out of pair 0 ran at the drain and read its last batch, 4
    # (batch 4 was staged before the fifth run returned, batch 5 maybe not)
    for t in (0, 2):
        assert np.array_equal(np.asarray(delivered[t][0]), expected[4][0])


def _old_placement(monkeypatch):
    """Before staging: the reader on the host, a Copy op per output."""
    monkeypatch.setattr(placement, "HOST_OP_TYPES", ("DataReader",))
    monkeypatch.setattr(placement, "STAGING_OP_TYPES", ())


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_training_is_bitwise_what_it_was_and_no_host_copy_in_the_iteration(
        emulated, monkeypatch, cuda_graph):
    config = tiny_config()
    iters = 5
    set_calls, stage_threads, runs, copies = [], [], [], []
    real_set, real_stage, real_run = DeviceArray.set, DataReader._stage, DataReader.run
    real_copy = gpu.streams.copy_to_device_async

    def spy_set(self, array, stream=None):
        set_calls.append((array, threading.current_thread().name))
        return real_set(self, array, stream)

    def spy_stage(self, pair, batch):
        stage_threads.append(threading.current_thread().name)
        return real_stage(self, pair, batch)

    def spy_run(self, ins, outs):
        runs.append(self._current)  # None: run() would take the batch itself
        return real_run(self, ins, outs)

    def spy_copy(dst, src):
        copies.append(src)
        return real_copy(dst, src)

    monkeypatch.setattr(DeviceArray, "set", spy_set)
    monkeypatch.setattr(DataReader, "_stage", spy_stage)
    monkeypatch.setattr(DataReader, "run", spy_run)
    monkeypatch.setattr(gpu.streams, "copy_to_device_async", spy_copy)
    new = train_simulated(config, 0, iters=iters, cuda_graph=cuda_graph)
    ws = new[2]
    # the batch went host -> device only as cudaMemcpyAsync out of the
    # staging pairs, written in the prefetch thread; no ndarray.set, no host
    # copy in the iteration; run() only queued the copy of the pair taken
    assert stage_threads and all(n.startswith("prefetch:") for n in stage_threads)
    assert None not in runs and not [a for a, _ in set_calls if a.shape == ws["data"].shape]
    batch_shape = ws["data"].shape
    data_copies = [a for a in copies if a.shape == batch_shape]
    # eager: one copy per iteration; with CUDA graphs the two first iterations
    # run eagerly and each pair's capture records its copy once, then replays
    assert len(data_copies) == (iters if not cuda_graph else 4)
    assert len({a.ctypes.data for a in data_copies}) == 2  # two alternating pinned buffers
    assert not any(isinstance(a, DeviceArray) for a in data_copies)

    monkeypatch.setattr(DataReader, "run", real_run)
    _old_placement(monkeypatch)
    old = train_simulated(config, 0, iters=iters, cuda_graph=cuda_graph)
    assert "data.h2d" in old[2].graph.ops  # the reference is the old structure
    assert old[0] == new[0]
    for name, value in old[1].items():
        assert value.tobytes() == new[1][name].tobytes(), name


def test_the_cpu_path_is_unchanged():
    """On the CPU the reader keeps no staging buffers and writes its outputs
    in run, as before."""
    k, _ = _reader()
    outs = [np.zeros((4, 2, 3, 3), np.float32), np.zeros(4, np.int64)]
    k.setup([], outs)
    assert k._pinned is None
    for t, (want_d, want_l) in enumerate(_expected(3)):
        k.run([], outs)
        np.testing.assert_array_equal(outs[0], want_d)
        np.testing.assert_array_equal(outs[1], want_l)
