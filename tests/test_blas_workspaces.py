"""A cuBLAS workspace per concurrently replayed graph (issue 35, item 4).

A captured product bakes its handle's workspace into the graph. Two
independent segments holding products replay on their own streams and may
overlap; sharing one workspace, their products would overwrite each
other's scratch (cuBLAS documentation, "Results reproducibility"). The
emulated device (tests/emulated_gpu) raises when two replays in flight on
different streams share a workspace; gpu/blas.py gives each replay stream
its own (``workspace_scope``)."""
import numpy as np
import pytest

import purine_mpi.gpu as gpu
from purine_mpi.graph import Graph
from purine_mpi.graph.core import Location
from purine_mpi.gpu import blas
from purine_mpi.ops.registry import OpKernel, Pending, register
from purine_mpi.runtime.factory import make_dispatcher
from tests.emulated_gpu import SimulatedRuntime, use_emulated_cupy


@register
class _Forward(OpKernel):
    """A comm op: y = x, delivered after a few polls (an allreduce stand-in)."""

    op_type = "TestBlasForward"
    category = "comm"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        sent = np.array(ins[0], copy=True)

        class _P(Pending):
            polls = 2

            def test(self):
                self.polls -= 1
                return self.polls <= 0

            def finish(self):
                outs[0][...] = sent
        return _P()


def _two_products():
    """x -> fc_a -> send_a; x -> fc_b -> send_b, both products on stream 0:
    they are independent and feed different comm ops, so each is a segment
    of its own, replayed on a stream of its own (both captured on the same
    capture stream, whose cuBLAS handle they shared)."""
    g = Graph("two_gemms")
    dev = Location(0, 0)
    g.add_blob("x", (6, 5), dtype="float32", location=dev)
    for i, name in enumerate("ab"):
        g.add_blob(f"w_{name}", (4, 5), dtype="float32", location=dev)
        g.add_op(f"fc_{name}", "InnerProduct", ["x", f"w_{name}"], [f"y_{name}"],
                 location=dev, thread=0)
        g.add_op(f"send_{name}", "TestBlasForward", [f"y_{name}"], [f"z_{name}"], {"seq": i},
                 location=dev)
    g.infer_shapes().validate()
    return g


@pytest.mark.parametrize("seed", range(3))
def test_independent_product_segments_replay_at_once_on_their_own_workspaces(
        monkeypatch, host_build_dir, seed):
    use_emulated_cupy(monkeypatch, host_build_dir)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    w = {n: rng.standard_normal((4, 5)).astype(np.float32) for n in "ab"}
    rt = SimulatedRuntime(seed, poll_steps=(1, 4))
    notes = []
    d = make_dispatcher(_two_products(), runtime=rt, cuda_graph=True, log=notes.append)
    try:
        assert len(d.segments()) == 2, d.segments()
        d.workspace.set("x", x)
        for n in "ab":
            d.workspace.set(f"w_{n}", w[n])
        for it in range(6):
            rt.stalled_polls = 3   # a busy GPU: the host launches both before either ends
            d.run(it)
            for n in "ab":
                np.testing.assert_allclose(np.asarray(d.workspace[f"z_{n}"]), x @ w[n].T,
                                           rtol=1e-5)
    finally:
        d.close()
        gpu.clear_kernel_cache()
    assert not [n for n in notes if "could not capture" in n], notes
    assert sum(g.launches for g in rt.graphs) >= 8   # the products were replayed
    workspaces = [g.workspaces for g in rt.graphs]
    assert all(workspaces) and not workspaces[0] & workspaces[1]
    # the replays did overlap (else this test could not fail)
    assert ("concurrent_replays" in {c[0] for c in rt.calls}), "the replays never overlapped"


def test_handles_are_per_scope_on_one_stream(monkeypatch, host_build_dir):
    """The same capture stream under two scopes: two handles, two workspaces."""
    use_emulated_cupy(monkeypatch, host_build_dir)
    rt = SimulatedRuntime(0)
    stream = rt.stream(0, "capture")
    handles = set()
    for scope in ((0, "graph0"), (0, "graph1"), (0, "graph0")):
        with blas.workspace_scope(scope):
            handles.add(blas.reserve(stream))
    assert len(handles) == 2


def _pool_ptrs(rt):
    return {int(s.ptr) for _, s in rt.pool.items()}


def test_a_closed_dispatcher_releases_its_streams_handles(monkeypatch, host_build_dir):
    """Closing a GPU dispatcher destroys the cuBLAS handles of its streams
    (capture scopes included) and drops their workspaces
    (``blas.release_streams``): a closed trainer's handles no longer stay in
    ``blas._handles`` with ``PURINE_CUBLAS_WORKSPACE_MB`` each. A handle of
    another stream stays; a runtime two dispatchers share keeps its handles
    until the second closes."""
    emulated = use_emulated_cupy(monkeypatch, host_build_dir)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    import cupy
    other = cupy.cuda.Stream(non_blocking=True)   # a stream no dispatcher owns
    blas.reserve(other)
    rt = SimulatedRuntime(0)
    first = make_dispatcher(_two_products(), runtime=rt, cuda_graph=True, log=lambda m: None)
    second = make_dispatcher(_two_products(), runtime=rt, cuda_graph=True, log=lambda m: None)
    try:
        for d in (first, second):
            d.workspace.set("x", x)
            for n in "ab":
                d.workspace.set(f"w_{n}", rng.standard_normal((4, 5)).astype(np.float32))
            for it in range(3):
                d.run(it)
        mine = _pool_ptrs(rt)
        held = {k: n for k, n in blas.made_handles().items() if k[1] in mine}
        assert len(held) >= 2 and all(n == blas.workspace_bytes() for n in held.values())
        live = set(blas._state["cublas"].handles)
        first.close()   # the runtime's other user still runs: its handles stay
        assert {k for k in blas.made_handles() if k[1] in mine} == set(held)
        second.run(3)
        second.close()
        assert not [k for k in blas.made_handles() if k[1] in mine]
        gone = live - set(blas._state["cublas"].handles)
        assert len(gone) == len(held)   # destroyed in the emulated cuBLAS too
        assert [k for k in blas.made_handles() if k[1] == int(other.ptr)]
        second.close()   # closing again releases nothing more, raises nothing
    finally:
        first.close()
        second.close()
        gpu.clear_kernel_cache()
    del emulated


@register
class _Faulting(OpKernel):
    """y = x, or an error (a kernel fault) while ``FAULT`` holds True."""

    op_type = "TestBlasFault"
    FAULT = [False]

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        if self.FAULT[0]:
            raise RuntimeError("an illegal memory access (simulated fault)")
        outs[0][...] = ins[0]


def test_a_dispatcher_closed_after_a_failed_run_leaves_the_device_alone(monkeypatch,
                                                                        host_build_dir):
    """A run that raised (an op's fault, a stall: a collective that never
    completes) leaves work on the streams that may never finish, or a
    device whose every call now fails: closing the dispatcher then must
    neither wait for its streams (a stuck collective: the run's
    ``finally: close()`` would hang for good, the StallError never
    reported, no rank aborting the job) nor destroy its cuBLAS handles
    (cublasDestroy synchronizes the device), nor raise in place of the
    run's error. A clean run's close releases them (above)."""
    use_emulated_cupy(monkeypatch, host_build_dir)
    g = _two_products()
    dev = Location(0, 0)
    g.add_op("fault", "TestBlasFault", ["z_a"], ["f"], location=dev, thread=0)
    g.infer_shapes()
    rt = SimulatedRuntime(0)
    d = make_dispatcher(g, runtime=rt, cuda_graph=False, log=lambda m: None)
    rng = np.random.default_rng(0)
    d.workspace.set("x", rng.standard_normal((6, 5)).astype(np.float32))
    for n in "ab":
        d.workspace.set(f"w_{n}", rng.standard_normal((4, 5)).astype(np.float32))
    try:
        d.run(0)
        mine = _pool_ptrs(rt)
        held = {k for k in blas.made_handles() if k[1] in mine}
        assert held
        _Faulting.FAULT[0] = True
        with pytest.raises(Exception, match="simulated fault"):
            d.run(1)

        def stuck():   # what a stream with a hung collective does
            raise AssertionError("close waited for the streams of a failed run")
        monkeypatch.setattr(rt, "sync_streams", stuck)
        d.close()
        assert {k for k in blas.made_handles() if k[1] in mine} == held
    finally:
        _Faulting.FAULT[0] = False
        monkeypatch.undo()
        d.close()
        gpu.clear_kernel_cache()
