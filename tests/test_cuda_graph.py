"""CUDA-graph capture and replay in the stream dispatcher (runtime/cuda_graph.py).

Without a GPU, against the simulated device of tests/emulated_gpu,
whose streams have CuPy's capture API (``begin_capture``, ``end_capture`` ->
a graph with ``launch(stream)``): work queued on a capturing stream is
recorded as graph nodes with their dependencies (a stream joins a capture by
waiting on a captured event, and must be joined back before the capture
ends), and a replay runs those nodes again in any order their dependencies
allow, interleaved with the other streams. So a missing fork, join or
cross-stream wait inside a capture shows as an op running before its
producer, or as results that differ from eager stream dispatch.

What this cannot show (see the closing note of the issue): CuPy's real
capture semantics -- allocations, cuBLAS workspaces and library calls
during a capture, kernel arguments frozen at capture time -- and MPI or
NCCL next to replays on a real device. Those tests are marked ``gpu``.
"""
import copy
import random

import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.graph import Graph
from purine_mpi.graph.core import Location
from purine_mpi.parallel.placement import place_on_device
from purine_mpi.job.replica import build_train_graph
from purine_mpi.ops.registry import OpKernel, Pending, register
from purine_mpi.parallel.data_parallel import compose_data_parallel
from purine_mpi.runtime.cuda_graph import (MAX_CAPTURES, GraphDispatcher, plan_segments,
                                           stage_order)
from purine_mpi.runtime.factory import make_dispatcher
from purine_mpi.runtime.streams_dispatcher import StreamDispatcher
from purine_mpi.runtime.trace import Profiler
from tests.conftest import make_job, run_cli_here
from tests.emulated_gpu import (SimulatedRuntime, check_order, cpu_workspace, emulated_gpu_env,
                                init_params, log_kernels, tiny_config, tiny_raw)


@register
class _Affine(OpKernel):
    """y = x * scale + shift (one kernel)."""

    op_type = "TestGraphAffine"

    @classmethod
    def infer(cls, attrs, ins):
        return [ins[0]]

    def run(self, ins, outs):
        np.multiply(ins[0], self.attrs.get("scale", 1.0), out=outs[0])
        outs[0] += self.attrs.get("shift", 0.0)


@register
class _NoGraph(_Affine):
    """An op whose kernel says it cannot be captured."""

    op_type = "TestGraphNotCapturable"
    capturable = False


@register
class _HostRandom(_Affine):
    """Adds noise drawn on the host from a generator it keeps."""

    op_type = "TestGraphHostRandom"
    needs_rng = True

    def run(self, ins, outs):
        super().run(ins, outs)
        outs[0] += self.rng.standard_normal(outs[0].shape)


@register
class _FakeAllreduce(OpKernel):
    """Allreduce over two identical ranks: y_i = 2 x_i, delivered after a
    few polls. ``on_post`` (a test hook) is called when it is posted."""

    op_type = "TestGraphFakeAllreduce"
    category = "comm"
    on_post = None

    @classmethod
    def infer(cls, attrs, ins):
        return list(ins)

    def run(self, ins, outs):
        if _FakeAllreduce.on_post is not None:
            _FakeAllreduce.on_post(self.op.name)
        sent = [np.array(x, copy=True) for x in ins]

        class _P(Pending):
            polls = 3

            def test(self):
                self.polls -= 1
                return self.polls <= 0

            def finish(self):
                for y, x in zip(outs, sent):
                    y[...] = 2 * x
        return _P()


def _graph_dispatcher(graph, runtime, cuda_graph=True, **kw):
    ws = cpu_workspace(graph)
    notes = []
    d = make_dispatcher(graph, runtime=runtime, workspace=ws, cuda_graph=cuda_graph,
                        log=notes.append, **kw)
    assert type(d) is (GraphDispatcher if cuda_graph else StreamDispatcher)
    log_kernels(d, runtime)
    d.notes = notes
    return d, ws


def _segment_of(d):
    return {m: name for name, ms in d.segments() for m in ms}


# ---------------------------------------------------------------- planning

def _plan(spec, comm_order=(), blockers=None, unordered=()):
    """spec: [(name, key, preds)]; key None: host op, 'comm': comm op;
    ``comm_order``: the posting (seq) order of the comm ops (default: spec
    order); ``unordered``: point-to-point ones."""
    order = [n for n, _, _ in spec]
    deps = {n: set(p) for n, _, p in spec}
    keys = {n: (None if k is None else (0, "comm") if k == "comm" else k) for n, k, _ in spec}
    comm = list(comm_order) or [n for n, k, _ in spec if k == "comm"]
    segs, _ = plan_segments(order, deps, keys, stage_order(order, deps, comm, unordered),
                            blockers or {})
    return segs


def test_segments_cut_exactly_at_host_comm_and_blocked_ops():
    g0, g1 = (0, 0), (0, 1)
    spec = [("a", g0, []), ("b", g1, ["a"]),          # one segment over two streams
            ("host", None, ["b"]),                     # a host op in the middle
            ("c", g0, ["host"]), ("d", g0, ["c"]),
            ("allreduce", "comm", ["d"]),              # communication
            ("e", g0, ["allreduce"]),
            ("rng", g0, ["e"]),                        # a GPU op that cannot be captured
            ("f", g1, ["rng"]), ("gpu1", (1, 0), ["f"]),  # another device
            ("g", g0, ["gpu1"])]
    assert _plan(spec, blockers={"rng": "draws random numbers on the host"}) == \
        [["a", "b"], ["c", "d"], ["e"], ["f"], ["gpu1"], ["g"]]
    # without cuts, one segment
    assert _plan([("a", g0, []), ("b", g1, ["a"]), ("c", g0, ["a", "b"])]) == [["a", "b", "c"]]


def test_backward_segments_end_at_each_bucket():
    """Backward of a 3-layer chain, one bucket per layer (top first): each
    bucket's segment holds the ops it needs and no op that only the buckets
    after it need; the updates after the allreduces form one more."""
    s = (0, 0)
    spec = [("fwd1", s, []), ("fwd2", s, ["fwd1"]), ("fwd3", s, ["fwd2"]),
            ("loss_grad", s, ["fwd3"]),
            ("w3", s, ["loss_grad"]), ("d3", s, ["loss_grad"]),
            ("w2", s, ["d3"]), ("d2", s, ["d3"]), ("w1", s, ["d2"]),
            ("ar0", "comm", ["w3"]), ("ar1", "comm", ["w2"]), ("ar2", "comm", ["w1"]),
            ("up3", s, ["ar0"]), ("up2", s, ["ar1"]), ("up1", s, ["ar2"])]
    assert _plan(spec) == [["fwd1", "fwd2", "fwd3", "loss_grad", "w3"], ["d3", "w2"],
                           ["d2", "w1"], ["up3", "up2", "up1"]]
    # the posting order decides: with the bottom bucket posted first, its
    # segment holds the whole chain down to it, and the others follow it
    assert _plan(spec, comm_order=["ar2", "ar1", "ar0"]) == \
        [["fwd1", "fwd2", "fwd3", "loss_grad", "d3", "d2", "w1"], ["w3"], ["w2"],
         ["up3", "up2", "up1"]]


def test_pipeline_send_recv_and_ps_push_pull_cut_segments_too():
    """A pipeline stage (and a parameter-server worker alike): what arrives
    by Recv (or a pull), the GPU work between, what leaves by Send (or a
    push) -- every comm op ends the segment before it and starts the next."""
    s = (0, 0)
    spec = [("recv_x", "comm", []), ("fwd1", s, ["recv_x"]), ("fwd2", s, ["fwd1"]),
            ("send_y", "comm", ["fwd2"]), ("recv_dy", "comm", ["send_y"]),
            ("bwd2", s, ["recv_dy", "fwd1"]), ("bwd1", s, ["bwd2"]),
            ("send_dx", "comm", ["bwd1"]), ("push_g", "comm", ["bwd2"]),
            ("pull_w", "comm", ["push_g"]), ("update", s, ["pull_w"])]
    p2p = ["recv_x", "send_y", "recv_dy", "send_dx", "push_g", "pull_w"]
    # point-to-point: posted when ready, so the push (ready after bwd2)
    # ends a segment before bwd1, although it comes later in seq order
    assert _plan(spec, unordered=p2p) == [["fwd1", "fwd2"], ["bwd2"], ["bwd1"], ["update"]]
    # were they collectives in this seq order, bwd1 would go with bwd2: the
    # push could not be posted before send_dx anyway
    assert _plan(spec) == [["fwd1", "fwd2"], ["bwd2", "bwd1"], ["update"]]


def _bucketed_graph(min_buckets=3, seed=0):
    """The tiny training graph (dropout on) composed for 2 data-parallel
    ranks, with the Allreduce ops simulated, placed on GPU 0; ops spread
    over streams at random."""
    graph, grads = build_train_graph(make_job(tiny_config()))
    plan = compose_data_parallel(graph, grads, 2, 0, min_buckets=min_buckets)
    for op in graph.ops.values():
        if op.op_type == "Allreduce":
            op.op_type = "TestGraphFakeAllreduce"
    place_on_device(graph, 0)
    rng = random.Random(seed)
    for op in graph.ops.values():
        if op.location.device >= 0 and op.op_type not in ("Copy", "TestGraphFakeAllreduce"):
            op.thread = rng.choice([0, 1])
    return graph, plan


def test_data_parallel_segments_cut_at_buckets():
    graph, plan = _bucketed_graph()
    d, _ = _graph_dispatcher(graph, SimulatedRuntime(0), seed=7)
    try:
        seg_of = _segment_of(d)
        deps = d.graph.dependencies()

        def ancestors(names):
            seen, todo = set(), list(names)
            while todo:
                n = todo.pop()
                for p in deps[n]:
                    if p not in seen:
                        seen.add(p)
                        todo.append(p)
            return seen

        producers = d.graph.producers()
        order = d.comm_order()
        assert len(order) >= 3
        bucket_segs = []
        for k, name in enumerate(order):
            op = d.graph.ops[name]
            writers = {p.name for b in op.inputs for p in producers[b]}
            segs = {seg_of[w] for w in writers}
            assert len(segs) == 1, (name, segs)  # one segment writes the bucket
            seg = segs.pop()
            bucket_segs.append(seg)
            # everything in it is needed by this bucket or an earlier one
            needed = ancestors([c for c in order[:k + 1]])
            members = dict(d.segments())[seg]
            assert set(members) <= needed, set(members) - needed
        # consecutive buckets end consecutive segments (buckets with several
        # layers' gradients: each bucket its own)
        assert len(set(bucket_segs)) == len(bucket_segs)
        # nothing captured is a host or comm op
        for name, members in d.segments():
            for m in members:
                op = d.graph.ops[m]
                assert op.location.device >= 0 and op.op_type not in (
                    "TestGraphFakeAllreduce", "DataReader")
    finally:
        d.close()


# -------------------------------------------------------- replay == eager

def _train_both(graph, iters, seed=0, **kw):
    """(eager stream dispatcher, graph dispatcher) over ``iters`` iterations
    of copies of ``graph``: losses and parameters of each."""
    out = []
    for cuda_graph in (False, True):
        g = copy.deepcopy(graph)
        rt = SimulatedRuntime(seed)
        d, ws = _graph_dispatcher(g, rt, cuda_graph=cuda_graph, seed=7, **kw)
        init_params(ws, g, 5)
        losses = []
        try:
            for it in range(iters):
                rt.log.clear()
                ws["iter"][...] = it
                d.run(it)
                check_order(rt.log, d.graph)
                losses.append(np.array(ws["loss"]))
            params = {p.name: np.array(ws[p.name]) for p in g.params()}
            out.append((losses, params, d, rt))
        finally:
            d.close()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_equals_eager_bitwise_over_iterations(seed):
    """Dropout on, gradients through buckets: every iteration after the
    first replays the captures, and losses and weights are bitwise those
    of eager stream dispatch."""
    graph, _ = _bucketed_graph(seed=seed)
    iters = 5
    (l_eager, p_eager, _, _), (l_graph, p_graph, d, rt) = _train_both(graph, iters, seed)
    for a, b in zip(l_eager, l_graph):
        np.testing.assert_array_equal(a, b)
    for name, value in p_eager.items():
        np.testing.assert_array_equal(p_graph[name], value)
    segments = d.segments()
    assert len(segments) >= 4
    assert len(rt.graphs) == len(segments)  # each captured once, after iteration 0
    assert [g.launches for g in rt.graphs] == [iters - 1] * len(segments)
    # every GPU op but the comm ops is captured: the device iteration
    # counter, dropout (Philox on the device, keyed by the iteration blob),
    # the lr policy, the updates. The data reader here writes host arrays
    # (no page-locked staging on this simulated device), so it runs eagerly
    # and says so; with staging it is captured (test_whole_iteration_...)
    captured = {m for _, ms in segments for m in ms}
    gpu_ops = {n for n, op in d.graph.ops.items() if op.location.device >= 0
               and op.op_type not in ("TestGraphFakeAllreduce", "DataReader")}
    assert captured == gpu_ops
    assert d.notes == ["cuda_graph: 1 GPU op(s) run eagerly between the captured segments: "
                       "'data' (DataReader: keeps host-side state that changes every run)"]
    assert {"drop.fwd", "solver.lr", "iter.count"} <= captured


def test_replay_on_the_emulated_device_equals_eager(host_build_dir, monkeypatch):
    """The ops' GPU branches (raw kernels compiled for the host, emulated
    CuPy arrays): replays give the losses and weights of eager dispatch."""

    import purine_mpi.gpu as gpu
    from tests.emulated_gpu import use_emulated_cupy, train_simulated
    config = tiny_config()
    use_emulated_cupy(monkeypatch, host_build_dir)
    try:
        eager = train_simulated(config, 0, iters=4, cuda_graph=False)
        replay = train_simulated(config, 0, iters=4, cuda_graph=True)
    finally:
        gpu.clear_kernel_cache()
    assert eager[0] == replay[0]
    for name, value in eager[1].items():
        np.testing.assert_array_equal(replay[1][name], value)


def _train_emulated(tmp_path, cuda_graph, max_iter, resume=None, out="run"):
    import json

    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer
    raw = tiny_raw(device=0, cuda_graph=cuda_graph)
    raw["data"]["test"] = dict(raw["data"]["train"], num_samples=20, shuffle=False)
    raw["solver"].update(max_iter=max_iter, test_interval=3, display=1)
    config = validate_config(raw, check_files=False)
    logs = []
    trainer = Trainer(make_job(config), str(tmp_path / out), log=logs.append, resume=resume)
    try:
        trainer.run()
        kinds = (type(trainer.train), type(trainer.test))
        reports = [d.capture_report() for d in (trainer.train, trainer.test)
                   if isinstance(d, GraphDispatcher)]
        params = {p: np.array(trainer.ws[p]) for p in trainer.graphs.params}
    finally:
        trainer.close()
    rows = []
    for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items()
                     if k not in ("time", "timestamp", "images_per_s")})
    return rows, params, kinds, reports, logs


def test_trainer_with_cuda_graphs_on_the_emulated_gpu(tmp_path, monkeypatch, host_build_dir):
    """train (device 0) on the emulated GPU: the train and the test graph
    each get their captures; losses, test figures and weights equal those
    of cuda_graph: false; a resumed run with capture on is bit-exact."""
    emulated_gpu_env(monkeypatch, host_build_dir)
    eager = _train_emulated(tmp_path, False, 6, out="eager")
    graph = _train_emulated(tmp_path, True, 6, out="graph")
    assert eager[2] == (StreamDispatcher, StreamDispatcher)
    assert graph[2] == (GraphDispatcher, GraphDispatcher)
    train_rep, test_rep = graph[3]
    for rep in (train_rep, test_rep):
        assert rep["segments"] >= 1 and rep["captured"] == rep["segments"]
        assert rep["failed"] == {} and rep["eager_gpu_ops"] == {}
    # the training iteration is one graph launch, nothing launched eagerly
    assert train_rep["segments"] == 1 and train_rep["launches_per_iter"] == 1
    assert train_rep["eager_ops_per_iter"] == 0
    assert graph[0] == eager[0] and any(r["phase"] == "test" for r in graph[0])
    for name, value in eager[1].items():
        np.testing.assert_array_equal(graph[1][name], value)
    # resume: 3 iterations, then 3 more from the checkpoint, capture on
    _train_emulated(tmp_path, True, 3, out="resumed")
    resumed = _train_emulated(tmp_path, True, 6, resume="auto", out="resumed")
    for name, value in graph[1].items():
        np.testing.assert_array_equal(resumed[1][name], value)
    assert resumed[0][-1] == graph[0][-1]


# ---------------------------------------------------------- concurrency

def _inception_graph(branches=4, depth=2):
    """x -> ``branches`` parallel branches of ``depth`` ops, each on its own
    stream -> their sum: the shape of an inception block."""
    g = Graph("inception")
    g.add_blob("x", (3,), location=Location(0, 0))
    tops = []
    for i in range(branches):
        prev = "x"
        for j in range(depth):
            out = f"b{i}_{j}"
            g.add_op(out, "TestGraphAffine", [prev], [out],
                     {"scale": 1.0 + i, "shift": float(j + 1)}, location=Location(0, 0), thread=i)
            prev = out
        tops.append(prev)
    g.add_op("concat", "Sum", tops, ["y"], location=Location(0, 0), thread=0)
    g.add_op("x_next", "TestGraphAffine", ["y"], ["z"], {"scale": 0.5},
             location=Location(0, 0), thread=1)
    g.infer_shapes().validate()
    return g


@pytest.mark.parametrize("seed", range(4))
def test_inception_branches_stay_concurrent_in_the_captured_graph(seed):
    g = _inception_graph()
    rt = SimulatedRuntime(seed)
    d, ws = _graph_dispatcher(g, rt)
    x = np.array([1.0, -2.0, 0.5])
    expect = 0.5 * sum((x * (1 + i) + 1) * (1 + i) + 2 for i in range(4))
    try:
        for it in range(3):
            ws.set("x", x)
            rt.log.clear()
            d.run(it)
            check_order(rt.log, d.graph)
            np.testing.assert_allclose(ws["z"], expect)
        assert d.segments() == [("graph0", [op.name for op in d.order])]
        (graph,) = rt.graphs
        assert sorted(graph.names()) == sorted(g.ops)  # one node per kernel launch
        assert graph.launches == 2
        branch = [[f"b{i}_{j}" for j in range(2)] for i in range(4)]
        for i in range(4):
            assert graph.ordered(branch[i][0], branch[i][1])
            assert graph.ordered(branch[i][1], "concat")
            for k in range(i + 1, 4):
                for a in branch[i]:
                    for b in branch[k]:
                        assert not graph.ordered(a, b), (a, b)
        # the capture used one stream per branch, forked from and joined
        # back into its origin
        captured_on = {c[1] for c in rt.calls if c[0] == "capture_launch"}
        assert len(captured_on) == 4
    finally:
        d.close()


# ---------------------------------------------------------- communication

def test_bucket_posted_when_its_segment_finished_while_the_next_one_runs():
    """Each bucket's allreduce is posted once the segment that writes it
    has finished on the device (its event, polled), while the segment of
    the next bucket is still running; a replay per segment."""
    graph, plan = _bucketed_graph()
    rt = SimulatedRuntime(3, poll_steps=(0, 1))
    d, ws = _graph_dispatcher(graph, rt, seed=7)
    seen = []

    def on_post(name):
        seg_of = _segment_of(d)
        writers = {p.name for b in d.graph.ops[name].inputs
                   for p in d.graph.producers()[b]}
        (seg,) = {seg_of[w] for w in writers}
        later = [s for s, _ in d.segments() if int(s[5:]) > int(seg[5:])
                 and s in d.executor.events]
        seen.append((d.iteration, name, d.executor.events[seg].done,
                     any(not d.executor.events[s].done for s in later)))

    _FakeAllreduce.on_post = on_post
    init_params(ws, graph, 5)
    try:
        for it in range(3):
            ws["iter"][...] = it
            d.run(it)
    finally:
        _FakeAllreduce.on_post = None
        d.close()
    order = d.comm_order()
    assert [n for _, n, _, _ in seen] == order * 3
    assert all(done for _, _, done, _ in seen)  # never before its segment finished
    # in the replayed iterations, every bucket but the last one was posted
    # while a later segment was still running on the device
    for it in (1, 2):
        overlapped = [busy for i, n, _, busy in seen if i == it and n != order[-1]]
        assert overlapped and all(overlapped), seen
    # the posts were polled, never a blocking sync on the segment's event
    segs = {name for name, _ in d.segments()}
    assert not [c for c in rt.calls if c[0] == "sync_event" and
                any(c[1] is d.executor.events.get(s) for s in segs)]


# ------------------------------------------------------- shape changes

def test_another_shape_gets_its_own_capture():
    g = _inception_graph(branches=2, depth=1)
    rt = SimulatedRuntime(0)
    d, ws = _graph_dispatcher(g, rt)

    def rebind(shape):
        """Give every kernel arrays of ``shape`` (another batch size)."""
        arrays = {b: np.zeros(shape) for b in g.blobs}
        for k in d.kernels.values():
            k.ins[:] = [arrays[b] for b in k.op.inputs]
            k.outs[:] = [arrays[b] for b in k.op.outputs]
        return arrays

    def expect(x):
        return 0.5 * sum(x * (1 + i) + 1 for i in range(2))

    try:
        big = {b: ws[b] for b in g.blobs}
        for it in range(2):
            ws.set("x", np.arange(3.0))
            d.run(it)
        assert len(rt.graphs) == 1
        small = rebind((2,))
        for it in range(2, 5):
            small["x"][...] = [5.0, 7.0]
            d.run(it)
            np.testing.assert_allclose(small["z"], expect(np.array([5.0, 7.0])))
        # run eagerly once, then captured for the new shape and replayed
        assert len(rt.graphs) == 2 and rt.graphs[1].launches == 2
        assert rt.graphs[0].launches == 1
        # the first shape again: its capture is replayed, nothing new captured
        for k in d.kernels.values():
            k.ins[:] = [big[b] for b in k.op.inputs]
            k.outs[:] = [big[b] for b in k.op.outputs]
        ws.set("x", np.arange(3.0))
        d.run(5)
        np.testing.assert_allclose(ws["z"], expect(np.arange(3.0)))
        assert len(rt.graphs) == 2 and rt.graphs[0].launches == 2
        # past MAX_CAPTURES shapes: eager, said once
        for n in range(3, 3 + MAX_CAPTURES):
            arrays = rebind((n,))
            for it in range(2):
                arrays["x"][...] = 1.0
                d.run(10 + it)
                np.testing.assert_allclose(arrays["z"], expect(np.ones(n)))
        assert len(rt.graphs) == MAX_CAPTURES
        assert sum("different sets of arrays" in n for n in d.notes) == 1
    finally:
        d.close()


# -------------------------------------------------------------- fallback

def test_an_op_that_cannot_be_captured_runs_eagerly_and_is_named_once():
    g = Graph("blocked")
    g.add_blob("x", (3,), location=Location(0, 0))
    g.add_op("a", "TestGraphAffine", ["x"], ["y1"], {"scale": 2.0}, location=Location(0, 0))
    g.add_op("b", "TestGraphNotCapturable", ["y1"], ["y2"], {"shift": 1.0},
             location=Location(0, 0))
    g.add_op("c", "TestGraphAffine", ["y2"], ["y3"], {"scale": 3.0}, location=Location(0, 0))
    g.add_op("noise", "TestGraphHostRandom", ["y3"], ["y4"], location=Location(0, 0))
    g.add_op("e", "TestGraphAffine", ["y4"], ["y5"], {"shift": 1.0}, location=Location(0, 0))
    g.infer_shapes().validate()
    rt = SimulatedRuntime(0)
    d, ws = _graph_dispatcher(g, rt, seed=4)
    noise = np.random.default_rng([4, __import__("zlib").crc32(b"noise")])
    try:
        for it in range(3):
            ws.set("x", np.arange(3.0))
            rt.log.clear()
            d.run(it)
            check_order(rt.log, g)
            np.testing.assert_allclose(ws["y3"], (np.arange(3.0) * 2 + 1) * 3)
            # a fresh draw every iteration (a replay would have frozen it)
            np.testing.assert_allclose(ws["y5"], ws["y3"] + noise.standard_normal(3) + 1)
        assert d.segments() == [("graph0", ["a"]), ("graph1", ["c"]), ("graph2", ["e"])]
        assert d.notes == ["cuda_graph: 2 GPU op(s) run eagerly between the captured segments: "
                           "'b' (TestGraphNotCapturable: its kernel cannot be captured), "
                           "'noise' (TestGraphHostRandom: draws random numbers on the host)"]
        report = d.capture_report()
        assert sorted(report["eager_gpu_ops"]) == ["b", "noise"]
        assert report["segments"] == report["captured"] == 3 and report["failed"] == {}
    finally:
        d.close()


def test_a_failed_capture_falls_back_to_eager_and_says_so_once():
    g = _inception_graph(branches=2, depth=1)
    rt = SimulatedRuntime(0)
    d, ws = _graph_dispatcher(g, rt)
    real_end = rt.end_capture

    def failing_end(device, stream):
        real_end(device, stream)
        raise RuntimeError("cudaErrorStreamCaptureInvalidated (simulated)")

    rt.end_capture = failing_end
    try:
        for it in range(4):
            ws.set("x", np.arange(3.0))
            d.run(it)
            np.testing.assert_allclose(ws["z"], 0.5 * sum(np.arange(3.0) * (1 + i) + 1
                                                          for i in range(2)))
        assert [c[0] for c in rt.calls].count("begin_capture") == 1  # tried once
        assert not any(c[0] == "launch_graph" for c in rt.calls)
        assert len(d.notes) == 1 and "could not capture graph0 (4 ops" in d.notes[0]
        assert "it runs eagerly" in d.notes[0]
        report = d.capture_report()
        assert report["captured"] == 0 and list(report["failed"]) == ["graph0"]
    finally:
        d.close()


# ------------------------------------------------------------------ trace

def test_trace_has_one_event_per_segment_replay_with_its_ops():
    graph, _ = _bucketed_graph()
    rt = SimulatedRuntime(0)
    d, ws = _graph_dispatcher(graph, rt, seed=7)
    d.profiler = Profiler()
    init_params(ws, graph, 5)
    try:
        for it in range(3):
            ws["iter"][...] = it
            d.run(it)
        segments = dict(d.segments())
        events = d.profiler.events
        seg_events = [e for e in events if e["cat"] == "cuda_graph"]
        assert len(seg_events) == 3 * len(segments)
        for e in seg_events:
            assert e["args"]["ops"] == segments[e["name"]]
            assert e["args"]["mode"] == ("eager" if e["args"]["iter"] == 0 else "replay")
            assert e["tid"] == "gpu0:graph" and e["dur"] >= 0
        captured = {m for ms in segments.values() for m in ms}
        # no per-op events for what a segment holds; the others keep theirs
        names = {e["name"] for e in events}
        assert not names & captured
        assert "data" in names
        from purine_mpi.runtime.trace import thread_label
        assert thread_label("gpu0:graph") == "CUDA graph replays gpu0"
    finally:
        d.close()


def test_without_cuda_graph_every_gpu_op_keeps_its_own_trace_event():
    graph, _ = _bucketed_graph()
    rt = SimulatedRuntime(0)
    d, ws = _graph_dispatcher(graph, rt, cuda_graph=False, seed=7)
    d.profiler = Profiler()
    init_params(ws, graph, 5)
    try:
        ws["iter"][...] = 0
        d.run(0)
        events = d.profiler.events
        assert not [e for e in events if e["cat"] == "cuda_graph"]
        assert {e["name"] for e in events} == set(graph.ops)
        assert not [c for c in rt.calls if c[0] in ("begin_capture", "launch_graph")]
    finally:
        d.close()


# ----------------------------------------------------------------- config

def test_cuda_graph_key():
    assert tiny_config()["cuda_graph"] is True
    assert tiny_config(cuda_graph=False)["cuda_graph"] is False
    with pytest.raises(ConfigError, match="cuda_graph.*expected true or false"):
        tiny_config(cuda_graph="maybe")


def test_cuda_graph_false_on_the_command_line_and_a_bad_value_exits_2(tmp_path):
    import subprocess
    import sys

    import yaml
    path = tmp_path / "tiny.yaml"
    raw = tiny_raw()
    raw["solver"]["max_iter"] = 1
    path.write_text(yaml.safe_dump(raw))
    bad = run_cli_here("train", path, "--out", tmp_path / "run", "--set", "cuda_graph=maybe")
    assert bad.returncode == 2, bad.stderr
    assert "cuda_graph" in bad.stderr and "expected true or false" in bad.stderr
    assert "Traceback" not in bad.stderr
    # on the CPU the key means nothing: both values train the same way
    good = subprocess.run([sys.executable, "-m", "purine_mpi", "train", str(path), "--out",
                           str(tmp_path / "run2"), "--set", "cuda_graph=false"],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr


def test_cuda_graph_chooses_the_dispatcher():
    graph, _ = build_train_graph(make_job(tiny_config()))
    place_on_device(graph, 0)
    for flag, cls in ((True, GraphDispatcher), (False, StreamDispatcher)):
        d = make_dispatcher(graph, runtime=SimulatedRuntime(0), workspace=cpu_workspace(graph),
                            cuda_graph=flag, log=lambda m: None)
        try:
            assert type(d) is cls
        finally:
            d.close()
    cpu_graph, _ = build_train_graph(make_job(tiny_config()))
    d = make_dispatcher(cpu_graph, cuda_graph=True)
    try:
        assert not isinstance(d, StreamDispatcher)  # the CPU's event dispatcher
    finally:
        d.close()


# ------------------------------------------------------- on a real GPU

@pytest.mark.gpu
def test_replay_on_a_real_gpu_equals_eager():
    """CuPy's real stream capture: the tiny net with dropout (eager) and
    buckets-free training; every segment captured, replays match eager."""
    from tests.conftest import cuda_cupy_or_skip
    cuda_cupy_or_skip()
    config = tiny_config()
    results = []
    for cuda_graph in (False, True):
        graph, _ = build_train_graph(make_job(config))
        place_on_device(graph, 0)
        notes = []
        d = make_dispatcher(graph, seed=3, cuda_graph=cuda_graph, log=notes.append)
        try:
            for p in graph.params():
                from purine_mpi.layers.fillers import fill
                d.workspace.set(p.name, fill(p, 5))
            losses = []
            for it in range(6):
                d.workspace["iter"][...] = it
                d.run(it)
                losses.append(float(d.workspace["loss"]))
            if cuda_graph:
                assert isinstance(d, GraphDispatcher)
                segs = list(d.executor.segment_plan.values())
                assert segs and all(s.failed is None and s.captures for s in segs), \
                    [(s.name, s.failed) for s in segs]
            params = {p.name: np.asarray(d.workspace[p.name].get()) for p in graph.params()}
            results.append((losses, params))
        finally:
            d.close()
    (l0, p0), (l1, p1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for name, value in p0.items():
        np.testing.assert_allclose(p1[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("nvmath", [True, False])
def test_bench_json_on_the_emulated_gpu_reports_blas_and_capture(monkeypatch, host_build_dir,
                                                                 nvmath):
    """``bench --json`` on a GPU names the cuBLAS binding and passes the
    CUDA-graph dispatcher's capture report through, JSON-safe."""
    import json

    from purine_mpi.tools.bench import format_bench, run_bench
    from purine_mpi.job.config import validate_config
    from tests.emulated_gpu import use_emulated_cupy
    emulated_gpu_env(monkeypatch, host_build_dir)
    use_emulated_cupy(monkeypatch, host_build_dir, nvmath=nvmath)
    config = validate_config(tiny_raw(device=0, cuda_graph=True), check_files=False)
    res = run_bench(make_job(config), iters=2, warmup=2)
    assert res["backend"] == "cupy" and res["dispatcher"] == "GraphDispatcher"
    assert res["blas"] == ("nvmath" if nvmath else "cupy")
    report = res["cuda_graph"]
    assert {"segments", "captured_ops", "captured", "failed", "eager_gpu_ops"} <= set(report)
    assert report["segments"] >= 1
    if nvmath:   # CuPy's cuBLAS refuses a capture: its segments may all fail
        assert report["captured"] >= 1
    assert json.loads(json.dumps(res)) == res
    text = format_bench(res)
    assert f"cuBLAS through {res['blas']}" in text and "CUDA graphs" in text
    # the device's memory: the arena holds the planned blobs after the kept ones
    arena, planned = res["device_arena_bytes"]["0"], res["device_planned_bytes"]["0"]
    assert 0 < planned < res["device_unplanned_bytes"]["0"] and planned < arena
    assert res["device_scratch_bytes"]["0"] > 0           # im2col columns
    assert res["device_pool_bytes"]["0"] >= arena
    assert "GPU 0 memory" in text and "planned for the blobs" in text


def test_gpu_benchmark_reports_both_modes(monkeypatch, capsys):
    """benchmarks/gpu_throughput.py: one entry per config with purine_mpi's
    eager and graph figures side by side (the measurement itself needs a
    GPU; here the timed runs are stubbed to check what is reported)."""
    import importlib.util
    import json
    import pathlib
    import types
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_throughput.py"
    spec = importlib.util.spec_from_file_location("gpu_throughput_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fake_cupy = types.SimpleNamespace(__version__="fake", cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceProperties=lambda d: {"name": b"sim"})))
    monkeypatch.setattr(bench, "require_gpu", lambda device, need_torch: fake_cupy)
    calls = []

    def fake_purine(config, device, iters, warmup, tf32, cuda_graph=False):
        calls.append(cuda_graph)
        out = {"seconds": 0.5 if cuda_graph else 1.0, "first_loss": 2.3, "last_loss": 2.2,
               "device_arena_bytes": 1, "streams": 3,
               "device_pool_bytes": 7 if cuda_graph else 9}
        if cuda_graph:
            out["capture"] = {"segments": 2, "captured_ops": 40, "captured": 2, "failed": {},
                              "eager_gpu_ops": {}}
        return out

    monkeypatch.setattr(bench, "bench_purine", fake_purine)
    assert bench.main(["--no-torch", "--iters", "10", "--batch", "4", "--configs",
                       str(path.parent.parent / "jobs" / "cifar10_quick.yaml")]) == 0
    report = json.loads(capsys.readouterr().out)
    (entry,) = report["results"]
    assert calls == [False, True]
    assert entry["purine_eager_images_per_s"] == 40.0 and entry["purine_graph_images_per_s"] == 80.0
    # the headline figure is train's default mode, graph replay
    assert entry["purine_images_per_s"] == 80.0 and entry["purine_mode"] == "graph"
    assert entry["purine_graph_segments"] == 2 and entry["purine_graph_failed"] == {}
    # the device memory of the headline mode; PyTorch's is null without it
    assert entry["purine_device_pool_bytes"] == 7 and entry["purine_eager_device_pool_bytes"] == 9
    assert entry["torch_eager_max_memory_allocated"] is None
    assert entry["purine_vs_torch_memory"] is None
    assert bench.main(["--no-torch", "--iters", "10", "--batch", "4", "--modes", "graph",
                       "--configs", str(path.parent.parent / "jobs" / "cifar10_quick.yaml")]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["results"]
    assert "purine_eager_images_per_s" not in entry and entry["purine_graph_iter_ms"] == 50.0
