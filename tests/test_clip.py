"""solver.clip_gradients: the ops against torch.nn.utils.clip_grad_norm_,
the graph pass on one rank (also with micro-batches and on an emulated GPU,
whose kernels are cuda/clip.cu compiled for the host), its config rules.
Across ranks: tests/mpi_scripts/clip_equiv.py (test_mpi_parallel.py)."""
import numpy as np
import pytest
import torch

from purine_mpi.base.errors import ConfigError
from purine_mpi.graph.clip import add_clip, update_ops
from purine_mpi.job.config import resolve_config
from purine_mpi.job.replica import build_train_graph
from purine_mpi.runtime.dispatcher import SerialDispatcher
from tests.conftest import make_job
from purine_mpi.parallel.placement import place_on_device, prepare_for_device
from purine_mpi.runtime.factory import make_dispatcher
from tests.emulated_gpu import SimulatedRuntime, compare, init_params, run_kernel, tiny_raw


def _torch_clip(grads, scales, clip):
    """The gradients the updates apply (scale * g), clipped by torch."""
    params = []
    for g, s in zip(grads, scales):
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float64))
        p.grad = torch.tensor(g.astype(np.float64) * s)
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    return [p.grad.numpy() for p in params], float(norm)


@pytest.mark.parametrize("clip", [0.3, 50.0])
def test_ops_match_torch_clip_grad_norm(clip):
    from purine_mpi.ops.catalog import get_kernel_class
    from purine_mpi.graph.core import Op
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s) for s in [(4, 3), (3,), (2, 2, 2)]]
    scales = [0.5, 0.5, 0.25]
    want, norm = _torch_clip(grads, scales, clip)
    norm_op = get_kernel_class("GradNormSq")(Op("n", "GradNormSq", [], [], {"scales": scales}))
    sumsq, partial = np.zeros(1), np.zeros(3 * 32)
    norm_op.run(grads, [sumsq, partial])
    assert np.sqrt(sumsq[0]) == pytest.approx(norm, rel=1e-12)
    scale_op = get_kernel_class("ClipScale")(Op("c", "ClipScale", [], [], {"clip": clip}))
    for g, s, w in zip(grads, scales, want):
        out = g.copy()
        scale_op.run([out, sumsq], [out])  # in place, as the alias g@clip
        np.testing.assert_allclose(out * s, w, rtol=1e-6 if clip < norm else 0)
    assert (clip < norm) == (clip == 0.3)  # one case clips, the other leaves g alone



def test_float32_norm_of_pieces_is_the_whole_norm():
    """GradNormSq accumulates in float64: a float32 gradient cut into
    pieces (ZeRO's shards; the pieces' sums added, as the Allreduce adds
    them) has the squared norm of the whole to 1e-14 relative, against
    the float64 sum of exact squares; the float32 clip factor is the same.
    (A float32 dot differed by ~1e-7: the sharded clip was not data
    parallelism's.)"""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    from purine_mpi.ops.clip import SUMSQ_CHUNK, clip_factor
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(3 * SUMSQ_CHUNK + 12345) * 1e-2).astype(np.float32)
    exact = float(np.sum(g.astype(np.float64) ** 2))
    op = get_kernel_class("GradNormSq")(Op("n", "GradNormSq", [], [], {"scales": [1.0]}))

    def norm(pieces):
        total = 0.0
        for piece in pieces:
            sumsq = np.zeros(1)
            op.attrs["scales"] = [1.0] * len(piece)
            op.run(piece, [sumsq, np.zeros(32 * len(piece))])
            total += float(sumsq[0])
        return total

    cuts = sorted([0, 7, 20001, SUMSQ_CHUNK + 3, 2 * SUMSQ_CHUNK + 999, g.size])
    whole = norm([[g]])
    for got in (norm([[g[a:b] for a, b in zip(cuts, cuts[1:])]]),  # one rank, many views
                norm([[g[a:b]] for a, b in zip(cuts, cuts[1:])])):  # ranks' sums added
        assert abs(got - exact) <= 1e-14 * exact and abs(whole - exact) <= 1e-14 * exact
        f32 = [np.float32(clip_factor(x, 0.01)) for x in (whole, got)]
        assert f32[0] == f32[1] and f32[0] < 1


def _config(clip=None, micro=1, **solver):
    raw = {"name": "clip", "seed": 2,
           "data": {"train": {"source": "synthetic", "shape": [1, 3, 4], "classes": 3,
                              "num_samples": 48, "batch_size": 6, "shuffle": True}},
           "net": [{"type": "fc", "name": "fc1", "bottom": "data", "top": "fc1",
                    "num_output": 5},
                   {"type": "relu", "name": "r", "bottom": "fc1", "top": "fc1"},
                   {"type": "fc", "name": "fc2", "bottom": "fc1", "top": "fc2",
                    "num_output": 3},
                   {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"],
                    "top": "loss"}],
           "solver": dict({"base_lr": 1.0, "momentum": 0.0, "weight_decay": 0.0,
                           "max_iter": 1, "clip_gradients": clip}, **solver),
           "parallel": {"micro_batches": micro}}
    return resolve_config(raw, "<test>", check_files=False)


class _OneRank:
    size, rank = 1, 0


def _one_step(config):
    """(params before, params after) of one iteration of the composed graph."""
    from purine_mpi.layers.fillers import fill
    from purine_mpi.parallel.compose import compose
    graph, grads = build_train_graph(make_job(config))
    graph = compose(graph, grads, make_job(config), _OneRank())
    d = SerialDispatcher(graph, seed=1)
    params = [b for b in graph.params()]
    before = {}
    for p in params:
        before[p.name] = fill(p, 7)
        d.workspace.set(p.name, before[p.name])
    d.workspace["iter"][...] = 0
    d.run(0)
    after = {p.name: np.array(d.workspace[p.name]) for p in params}
    d.close()
    return graph, before, after


@pytest.mark.parametrize("micro", [1, 2])
def test_one_step_clips_the_applied_gradient_like_torch(micro):
    """lr 1, no momentum or decay: the step is the gradient the update
    applies. With clipping it is torch's clip_grad_norm_ of the step without."""
    _, before, plain = _one_step(_config(None, micro))
    names = sorted(before)
    raw = [before[n] - plain[n] for n in names]
    norm = float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in raw)))
    for clip, clips in ((0.5 * norm, True), (2 * norm, False)):
        graph, _, after = _one_step(_config(clip, micro))
        assert [op.op_type for op in graph.ops.values()].count("ClipScale") == len(names)
        assert all(op.inputs[1].endswith("@clip") for op in update_ops(graph))
        want, got_norm = _torch_clip(raw, [1.0] * len(raw), clip)
        assert got_norm == pytest.approx(norm, rel=1e-6)
        for n, w in zip(names, want):
            if clips:
                np.testing.assert_allclose(before[n] - after[n], w, rtol=1e-4, atol=1e-6)
            else:
                np.testing.assert_array_equal(after[n], plain[n])


def test_clip_config_rules():
    assert _config(2.0)["solver"]["clip_gradients"] == 2.0
    with pytest.raises(ConfigError, match="solver.clip_gradients"):
        _config(0)
    raw = {"net": [{"type": "fc", "name": "f", "bottom": "data", "top": "f", "num_output": 2}],
           "solver": {"clip_gradients": 1.0}, "parallel": {"mode": "async"}}
    with pytest.raises(ConfigError, match="clip_gradients.*mode 'async'"):
        resolve_config(raw, "<t>", check_files=False)


# ------------------------------------------------------------------ GPU
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_grad_norm_gpu_branch(device, dtype):  # noqa: F811
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(s).astype(dtype) for s in [(37, 5), (3,), (70,)]]
    attrs = {"scales": [1.0, 0.5, 2.0]}
    device.launched.clear()
    got = run_kernel("GradNormSq", attrs, grads, device.to_device)[0]  # (partials: scratch)
    assert device.launched == ["grad_sumsq"] * 3 + ["clip_total"]
    cpu = run_kernel("GradNormSq", attrs, grads)[0]
    want = sum(s * s * (g.astype(np.float64) ** 2).sum() for g, s in zip(grads, [1, .5, 2]))
    tol = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got[0], want, rtol=tol)
    np.testing.assert_allclose(cpu[0], want, rtol=tol)


def _stripe_partials(g, scale2, slots, threads):
    """grad_sumsq's partial sums by their definition (cuda/clip.cu): slot
    s, thread t adds g[i]^2 in float64 for i = s*B + t + k*slots*B in
    increasing i (B = ``threads``), one add at a time; the block's tree
    adds thread t + d into t for d = 1, 2, 4, ...; times ``scale2``."""
    flat = g.reshape(-1).astype(np.float64)
    out = []
    for s in range(slots):
        sums = []
        for t in range(threads):
            acc = 0.0
            for v in flat[s * threads + t::slots * threads]:
                acc = acc + v * v
            sums.append(acc)
        d = 1
        while d < threads:
            for t in range(0, threads, 2 * d):
                if t + d < threads:
                    sums[t] = sums[t] + sums[t + d]
            d *= 2
        out.append(scale2 * sums[0])
    return np.array(out)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_grad_norm_is_one_launch_over_every_gradient_with_the_same_bits(device, dtype):  # noqa: F811
    """With its table (setup), GradNormSq is one ``grad_sumsq_multi`` over
    every gradient (largest first) and ``clip_total``: bit for bit the
    partial sums of one ``grad_sumsq`` per gradient, and on the emulated
    device (blocks of 3 threads) those of the kernel's definition, loads
    batched or not (gradients past 16 x 32 x 3 elements take the batches)."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.catalog import get_kernel_class
    from purine_mpi.ops.clip import CLIP_SLOTS
    rng = np.random.default_rng(6)
    shapes = [(37, 5), (3,), (70,), (5003,), (40, 25)]
    grads = [rng.standard_normal(s).astype(dtype) for s in shapes]
    scales = [1.0, 0.5, 2.0, 0.25, 1.0 / 3]
    op = get_kernel_class("GradNormSq")(Op("n", "GradNormSq", [], [], {"scales": scales}))
    ins = [device.to_device(g) for g in grads]
    outs = [device.to_device(np.full(1, np.nan)),
            device.to_device(np.full(len(grads) * CLIP_SLOTS, np.nan))]
    op.setup(ins, outs)
    device.launched.clear()
    op.run(ins, outs)
    assert device.launched == ["grad_sumsq_multi", "clip_total"]
    multi = np.array(device.to_host(outs[1]))
    total = np.array(device.to_host(outs[0]))
    op._table = None   # one grad_sumsq per gradient
    device.launched.clear()
    op.run(ins, outs)
    assert device.launched == ["grad_sumsq"] * len(grads) + ["clip_total"]
    np.testing.assert_array_equal(multi.view(np.uint64),
                                  np.array(device.to_host(outs[1])).view(np.uint64))
    np.testing.assert_array_equal(total.view(np.uint64),
                                  np.array(device.to_host(outs[0])).view(np.uint64))
    if device.name == "emulated":
        from tests.emulated_gpu.host_kernels import _EMU_THREADS
        want = np.concatenate([_stripe_partials(g, s * s, CLIP_SLOTS, _EMU_THREADS)
                               for g, s in zip(grads, scales)])
        np.testing.assert_array_equal(multi.view(np.uint64), want.view(np.uint64))
    # gradients that moved since setup: one launch each again, the same sums
    moved = [device.to_device(np.array(device.to_host(a))) for a in ins]
    device.launched.clear()
    op.setup(ins, outs)
    op.run(moved, outs)
    assert device.launched == ["grad_sumsq"] * len(grads) + ["clip_total"]
    np.testing.assert_array_equal(np.array(device.to_host(outs[1])).view(np.uint64),
                                  multi.view(np.uint64))


@pytest.mark.parametrize("clip", [0.5, 1e3])
def test_clip_scale_gpu_branch(device, clip):  # noqa: F811
    g = np.random.default_rng(4).standard_normal((9, 4)).astype(np.float32)
    sumsq = np.asarray([float((g.astype(np.float64) ** 2).sum())])
    compare(device, "ClipScale", {"clip": clip}, [g, sumsq], ["clip_scale"], np.float32)


@pytest.mark.parametrize("fused,captured", [(False, False), (True, False), (True, True)],
                         ids=["placed", "placed+fused", "fused+cuda_graph"])
def test_training_on_an_emulated_gpu_clips_as_the_cpu(host_build_dir, monkeypatch, fused,
                                                      captured):
    """A placed training graph with the clip pass, ops on the emulated
    device run by the stream dispatcher: the norm never leaves the device
    (the clip ops read device blobs only) and the weights match the CPU."""
    from purine_mpi.gpu import kernels
    from tests.emulated_gpu import use_emulated_cupy
    config = resolve_config(tiny_raw(solver={"base_lr": 0.05, "momentum": 0.9,
                                              "clip_gradients": 0.05}),
                            "<t>", check_files=False)

    def train(where):
        graph, _ = build_train_graph(make_job(config))
        add_clip(graph, config["solver"]["clip_gradients"]).validate()
        if fused and where >= 0:
            prepare_for_device(graph, where)
        else:
            place_on_device(graph, where)
        if where >= 0:
            for op in graph.ops.values():
                if op.op_type in ("GradNormSq", "ClipScale"):
                    assert op.location.device == 0
                    assert all(graph.blobs[b].location.device == 0
                               for b in op.inputs + op.outputs), op.name
            d = make_dispatcher(graph, runtime=SimulatedRuntime(1), seed=3,
                                cuda_graph=captured)
        else:
            d = SerialDispatcher(graph, seed=3)
        try:
            init_params(d.workspace, graph, 5)
            for it in range(3):
                d.workspace["iter"][...] = it
                d.run(it)
            return {p.name: np.array(d.workspace[p.name]) for p in graph.params()}
        finally:
            d.close()

    cpu = train(-1)
    use_emulated_cupy(monkeypatch, host_build_dir)
    launched = []
    real = kernels.base._launch_blocks
    monkeypatch.setattr(kernels.base, "_launch_blocks", lambda source, func, *a: (
        launched.append(func), real(source, func, *a))[1])
    try:
        got = train(0)
    finally:
        from purine_mpi import gpu
        gpu.clear_kernel_cache()
    # one launch over every gradient (the table built at setup)
    assert {"grad_sumsq_multi", "clip_total"} <= set(launched) and "grad_sumsq" not in launched
    for name, value in cpu.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6)


def _scaled_by_definition(g, sumsq, clip):
    """clip_scale's result by its definition (cuda/clip.cu): each element
    times clip / sqrt(sumsq) in double, rounded to g's dtype, when that
    norm exceeds clip; else g."""
    norm = np.sqrt(np.float64(sumsq))
    if not norm > clip:
        return g
    return (g.astype(np.float64) * (np.float64(clip) / norm)).astype(g.dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("clip", [0.5, 1e3])
def test_clip_scale_is_one_launch_over_every_gradient_with_the_same_bits(device, dtype,  # noqa: F811
                                                                          clip):
    """A ClipScale over several gradients (parallel/fuse.py's fuse_clip) is
    one ``clip_scale_multi`` launch over the table built at setup: bit for
    bit one ``clip_scale`` per gradient and, on the emulated device, the
    kernel's definition; clipping (norm above the clip) or not. A gradient
    past CLIP_SCALE_CHUNK elements takes several items. Gradients that
    moved since setup: one ``clip_scale`` each again, the same bits."""
    from purine_mpi.graph.core import Op
    from purine_mpi.gpu.kernels.step import CLIP_SCALE_CHUNK
    from purine_mpi.ops.catalog import get_kernel_class
    rng = np.random.default_rng(8)
    shapes = [(37, 5), (3,), (CLIP_SCALE_CHUNK + 907,), (70,), (40, 25)]
    grads = [rng.standard_normal(s).astype(dtype) for s in shapes]
    sumsq = np.asarray([sum(float((g.astype(np.float64) ** 2).sum()) for g in grads)])
    assert (np.sqrt(sumsq[0]) > clip) == (clip == 0.5)
    op = get_kernel_class("ClipScale")(Op("c", "ClipScale", [], [], {"clip": clip}))

    def scaled(table):
        outs = [device.to_device(g) for g in grads]   # in place, as the aliases g@clip
        ins = outs + [device.to_device(sumsq)]
        op.setup(ins, outs)
        if table == "none":
            op._table = None
        elif table == "moved":
            outs = [device.to_device(np.array(device.to_host(a))) for a in outs]
            ins = outs + ins[-1:]
        device.launched.clear()
        op.run(ins, outs)
        return [np.array(device.to_host(a)) for a in outs], list(device.launched)

    multi, launched = scaled("built")
    assert launched == ["clip_scale_multi"]
    for how in ("none", "moved"):
        each, launched = scaled(how)
        assert launched == ["clip_scale"] * len(grads)
        for a, b in zip(multi, each):
            np.testing.assert_array_equal(a, b)
    if device.name == "emulated":
        for g, got in zip(grads, multi):
            want = _scaled_by_definition(g, sumsq[0], clip)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
            assert (got != g).any() == (clip == 0.5)


@pytest.mark.parametrize("clip", [1e-3, 1e3], ids=["clipping", "not clipping"])
def test_a_fused_clip_trains_bit_for_bit_as_one_clip_per_gradient(host_build_dir, monkeypatch,
                                                                   clip):
    """A training graph placed and fused on the emulated device: its
    ClipScale ops are one (``clip.scale``), one ``clip_scale_multi`` launch
    per iteration and no ``clip_scale``; the weights after three steps
    (momentum and weight decay after the clip), eagerly and captured as a
    CUDA graph, are those of the graph without ``fuse_clip`` bit for bit,
    clipping or not; its third iteration allocates nothing."""
    from purine_mpi.gpu import kernels
    from purine_mpi.parallel import fuse
    from tests.emulated_gpu import Allocations, use_emulated_cupy
    config = _config(clip, momentum=0.9, weight_decay=1e-3, base_lr=0.1)
    use_emulated_cupy(monkeypatch, host_build_dir)
    launched = []
    for name in ("_launch", "_launch_blocks"):
        real = getattr(kernels.base, name)
        monkeypatch.setattr(kernels.base, name, lambda source, func, *a, real=real: (
            launched.append(func), real(source, func, *a))[1])

    def train(fused, captured):
        graph, _ = build_train_graph(make_job(config))
        add_clip(graph, clip).validate()
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(fuse, "fuse_clip", lambda graph: [])
            prepare_for_device(graph, 0)
        clips = [op for op in graph.ops.values() if op.op_type == "ClipScale"]
        grads = len(update_ops(graph)) or len(graph.ops["solver.update"].attrs["params"])
        assert [len(op.outputs) for op in clips] == ([grads] if fused else [1] * grads)
        d = make_dispatcher(graph, runtime=SimulatedRuntime(1), seed=3, cuda_graph=captured)
        try:
            init_params(d.workspace, graph, 5)
            for it in range(3):
                d.workspace["iter"][...] = it
                launched.clear()
                Allocations.log, Allocations.counting = [], it == 2
                try:
                    d.run(it)
                finally:
                    Allocations.counting = False
                if not captured:
                    assert launched.count("clip_scale_multi") == (1 if fused else 0)
                    assert launched.count("clip_scale") == (0 if fused else grads)
            assert Allocations.log == [], Allocations.log
            norm = float(np.sqrt(np.asarray(d.workspace["clip.sumsq"])[0]))
            assert (norm > clip) == (clip == 1e-3)
            return {p.name: np.array(d.workspace[p.name]) for p in graph.params()}
        finally:
            d.close()

    try:
        each = train(False, False)
        for captured in (False, True):
            got = train(True, captured)
            assert sorted(got) == sorted(each)
            for name, value in each.items():
                np.testing.assert_array_equal(got[name], value, err_msg=name)
    finally:
        from purine_mpi import gpu
        gpu.clear_kernel_cache()
