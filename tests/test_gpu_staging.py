"""Data-parallel buckets on the emulated GPU with a non-CUDA-aware MPI
(issue #25): the host staging is asynchronous and event-ordered, each
bucket is posted as its own readiness event fires, in ``seq`` order, while
the backward still runs, and the weights equal the CUDA-aware path's (the
device buffer handed to MPI directly) bit for bit, with random comm delays.

The MPI communicator of the Allreduce kernels is a stand-in for the second
rank (its ``Iallreduce`` adds a fixed multiple of the buffer, as a second
rank with another gradient would, and checks what it is handed); the
requests are real mpi4py requests (``COMM_SELF.Ibarrier``).
"""
import threading

import numpy as np
import pytest

from purine_mpi.comm import device as comm_device
from purine_mpi.parallel.placement import prepare_for_device
from purine_mpi.job.replica import build_train_graph
from purine_mpi.parallel.data_parallel import compose_data_parallel
from purine_mpi.runtime.cuda_runtime import COMM_STREAM
from purine_mpi.runtime.factory import make_dispatcher
from purine_mpi.runtime.streams_dispatcher import COPY_OUT_STREAM
from tests import emulated_gpu
from tests.conftest import make_job
from tests.emulated_gpu import DeviceArray, SimulatedRuntime, init_params, tiny_config

ITERS = 4


@pytest.fixture
def emulated(emulated):
    """The shared fixture's (tests/emulated_gpu/fixtures.py), the CUDA-aware
    MPI answer forgotten after the test."""
    yield emulated
    comm_device.cuda_aware.cache_clear()


class _OtherRank:
    """The communicator of a 2-rank world whose other rank contributes
    ``factor`` times this rank's buffer; logs each post with a check of its
    buffer (a host array holding what the device holds, when staged)."""

    def __init__(self, dispatcher, runtime, factor=0.5):
        self.d, self.rt, self.factor = dispatcher, runtime, factor
        self.posts = []
        self.comm = self

    def Get_size(self):
        return 2

    def Iallreduce(self, sendbuf, recvbuf, op=None):
        from mpi4py import MPI
        assert sendbuf is MPI.IN_PLACE
        d = self.d
        name = next(n for n, k in d.kernels.items()
                    if getattr(k, "buffers", None) is not None and
                    any(np.shares_memory(np.asarray(st.host if st.staged else st.array),
                                         np.asarray(recvbuf)) for st in k.stages))
        k = d.kernels[name]
        (stage,) = k.stages
        staged = not isinstance(recvbuf, DeviceArray)
        event = d.executor.staged_out.get(name)
        producers = {p.name for b in d.graph.ops[name].inputs
                     for p in d.graph.producers()[b]}
        last = d.comm_order()[-1]
        last_producers = {p.name for b in d.graph.ops[last].inputs
                          for p in d.graph.producers()[b]}
        self.posts.append({
            "name": name, "iteration": d.iteration, "staged": staged,
            "event_done": event is not None and event.done,
            # the mirror holds exactly what the device holds (the copy ran)
            "mirror_ok": bool(np.array_equal(np.asarray(recvbuf), np.asarray(stage.array))),
            "producers_ran": producers <= set(self.rt.log),
            "backward_left": not last_producers <= set(self.rt.log),
            "thread": threading.current_thread().name})
        np.asarray(recvbuf)[...] += self.factor * np.asarray(recvbuf)
        return MPI.COMM_SELF.Ibarrier()


def _run(cuda_aware, cuda_graph, monkeypatch, seed=0, delay="0.3:5"):
    monkeypatch.setenv("PURINE_MPI_CUDA_AWARE", "1" if cuda_aware else "0")
    monkeypatch.setenv("PURINE_COMM_DELAY", delay)
    comm_device.cuda_aware.cache_clear()
    graph, grads = build_train_graph(make_job(tiny_config()))
    compose_data_parallel(graph, grads, 2, 0, min_buckets=3)
    prepare_for_device(graph, 0)
    rt = SimulatedRuntime(seed, poll_steps=(0, 2))
    d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=cuda_graph, log=lambda m: None)
    world = _OtherRank(d, rt)
    for k in d.kernels.values():
        if k.op.op_type == "Allreduce":
            k.world = world
    init_params(d.workspace, graph, 5)
    emulated_gpu.SYNC_COPIES.clear()
    emulated_gpu.MEMCPY_LOG.clear()
    try:
        for it in range(ITERS):
            d.workspace["iter"][...] = it
            del rt.log[:]
            d.run(it)
        weights = {p.name: np.array(d.workspace[p.name]) for p in graph.params()}
    finally:
        d.close()
    return d, rt, world, weights


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["captured", "eager"])
def test_staging_is_asynchronous_event_ordered_and_bitwise_like_cuda_aware_mpi(
        emulated, monkeypatch, cuda_graph):
    want = _run(True, cuda_graph, monkeypatch)
    d0, _, world0, _ = want
    assert world0.posts and not any(p["staged"] for p in world0.posts)  # MPI got device memory
    d, rt, world, got = _run(False, cuda_graph, monkeypatch)
    order = d.comm_order()
    assert len(order) >= 3
    # no synchronous copy at all: neither CuPy's get nor its set
    assert emulated_gpu.SYNC_COPIES == []
    # every bucket: one device-to-host copy on the staging stream and one
    # host-to-device copy back on the comm stream, per iteration
    runtime = emulated.cuda.runtime
    d2h = [s for kind, s in emulated_gpu.MEMCPY_LOG if kind == runtime.memcpyDeviceToHost]
    h2d = [s for kind, s in emulated_gpu.MEMCPY_LOG if kind == runtime.memcpyHostToDevice
           and s == (0, COMM_STREAM)]
    assert d2h == [(0, COPY_OUT_STREAM)] * (len(order) * ITERS)
    assert len(h2d) == len(order) * ITERS
    posts = world.posts
    # in seq order, every iteration; never before the staging copy's event
    assert [p["name"] for p in posts] == order * ITERS
    assert all(p["staged"] and p["event_done"] and p["mirror_ok"] and p["producers_ran"]
               for p in posts), posts
    # the first bucket goes out while the backward still runs (the writers
    # of the last bucket have not all run on the device), every iteration;
    # later ones may or may not, as the simulated device's steps fall
    first = [p["backward_left"] for p in posts if p["name"] == order[0]]
    assert len(first) == ITERS and all(first), [(p["iteration"], p["name"], p["backward_left"])
                                                for p in posts]
    # the staging copies waited on the device for the buckets' writers
    copy_key = (0, COPY_OUT_STREAM)
    assert any(c[0] == "wait" and c[1] == copy_key for c in rt.calls)
    assert not any(c[0] == "sync_event" and any(c[1] is e for e in d.executor.copied_back.values())
                   for c in rt.calls)
    # the same weights, bit for bit, as MPI reading device memory directly
    for name, w in want[3].items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    for k in (k for k in d.kernels.values() if k.op.op_type == "Allreduce"):
        assert k.async_staging


def test_the_mirrors_are_planned_once_and_page_locked(emulated, monkeypatch):
    monkeypatch.setenv("PURINE_MPI_CUDA_AWARE", "0")
    comm_device.cuda_aware.cache_clear()
    array = np.arange(6, dtype=np.float32).view(DeviceArray)
    stage = comm_device.HostStage(array)
    assert stage.staged and emulated_gpu.pinned_range(stage.host.ctypes.data,
                                                         stage.host.nbytes)
    rt = SimulatedRuntime(0)
    copy = rt.stream(0, COPY_OUT_STREAM)
    rt.launch(0, copy, stage.copy_out_async, "d2h")
    event = rt.record(0, copy)
    assert not stage.host.any()  # queued, not run: the host did not wait
    rt.sync_event(event)
    np.testing.assert_array_equal(stage.host, np.arange(6))
    mirror = stage.host
    assert stage.buffer(copy_in=True) is mirror  # no second (synchronous) copy
    emulated_gpu.SYNC_COPIES.clear()
    mirror *= 10
    rt.launch(0, rt.stream(0, COMM_STREAM), stage.copy_back_async, "h2d")
    np.testing.assert_array_equal(np.asarray(array), np.arange(6))  # not yet
    rt.sync_streams()
    np.testing.assert_array_equal(np.asarray(array), 10 * np.arange(6))
    assert emulated_gpu.SYNC_COPIES == [] and stage.host is mirror


def test_the_trace_shows_each_staging_copy_on_its_stream(emulated, monkeypatch):
    """With a profiler: per bucket and iteration one ``staging`` event for
    the copy to the host mirror (on the ``stage_d2h`` row) and one for the
    copy back (on the ``comm`` row); they are what bench's
    ``staging_ms_per_iter`` adds up."""
    from purine_mpi.runtime.cuda_runtime import stream_thread_name
    from purine_mpi.runtime.trace import Profiler
    monkeypatch.setenv("PURINE_MPI_CUDA_AWARE", "0")
    comm_device.cuda_aware.cache_clear()
    graph, grads = build_train_graph(make_job(tiny_config()))
    compose_data_parallel(graph, grads, 2, 0, min_buckets=3)
    prepare_for_device(graph, 0)
    rt = SimulatedRuntime(1)
    d = make_dispatcher(graph, runtime=rt, seed=3, cuda_graph=True, log=lambda m: None)
    world = _OtherRank(d, rt)
    for k in d.kernels.values():
        if k.op.op_type == "Allreduce":
            k.world = world
    init_params(d.workspace, graph, 5)
    d.profiler = Profiler(0)
    try:
        for it in range(2):
            d.workspace["iter"][...] = it
            d.run(it)
    finally:
        d.close()
    order = d.comm_order()
    staging = [e for e in d.profiler.events if e.get("cat") == "staging"]
    got = sorted((e["args"]["iter"], e["name"], e["tid"]) for e in staging)
    want = sorted((it, f"{n}:{way}", stream_thread_name(0, stream)) for it in range(2)
                  for n in order for way, stream in (("d2h", COPY_OUT_STREAM),
                                                     ("h2d", COMM_STREAM)))
    assert got == want
    assert all(e["dur"] >= 0 for e in staging)


# ---------------------------------------------------------- on a real GPU

@pytest.mark.gpu
@pytest.mark.slow
def test_two_ranks_on_one_gpu_stage_their_buckets():
    """On a GPU machine, 2 ranks on one GPU (the mpich wheel: host staging)
    run the staged path and report its figures. The issue's speed targets
    (comm_overlap >= 0.5, >= 0.9 x one rank's images/s, worst post latency
    <= 0.1 ms) are measured by benchmarks/gpu_session.sh bench
    (gpu_dp.json), not asserted here."""
    import json

    from tests.conftest import cuda_cupy_or_skip, run_mpi_cli
    cuda_cupy_or_skip()
    args = ["bench", "jobs/cifar10_quick.yaml", "--set", "device=0", "--iters", "20", "--json"]
    two = run_mpi_cli(2, *args, timeout=600)
    assert two.returncode == 0, two.stderr
    r2 = json.loads(two.stdout.strip().splitlines()[-1])
    assert r2["world_size"] == 2 and r2["staging_ms_per_iter"] > 0
    assert 0.0 <= r2["comm_overlap"] <= 1.0 and "post_latency_ms_worst" in r2, r2


@pytest.mark.mpi
def test_two_emulated_gpus_with_staged_buckets_equal_one_rank_with_twice_the_batch(
        host_build_dir):
    """2 ranks under mpiexec, each on its own emulated GPU with captured
    iterations and asynchronously staged buckets (a non-CUDA-aware MPI),
    random comm delays: the weights equal one CPU rank with batch 2B, and
    each other bitwise (tests/mpi_scripts/dp_equiv_gpu.py)."""
    from tests.mpi_scripts.launch import run_mpi
    proc, _ = run_mpi("dp_equiv_gpu.py", 2, host_build_dir, timeout=240,
                      env={"PURINE_COMM_DELAY": "2:7"})
    assert proc.stdout.count("OK dp_equiv_gpu") == 2, proc.stdout + proc.stderr
