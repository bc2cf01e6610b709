"""GELU's gradient with the fc bias gradient in the same pass
(cuda/activation.cu ``gelu_backward[_bdy][_bx][_copy]_colsum_f32``,
``kernels.gelu_backward_bias_grad``) against the two kernels it replaces
(``gelu_backward`` then ``sum_rows``): dx, its bits copy, the partial sums
and db bit for bit; db against a float64 NumPy reference; the fallback
(cols not a multiple of 4, bases off the grid) takes the two kernels. On the
emulated device (blocks of a few threads), on whole 256-thread blocks of
the host-compiled kernel, and on a GPU when there is one (``gpu``)."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels
from tests.test_gpu_bias_gelu_vec import _bf16_bits, _host, _placed, _special

# (dy bits, x bits, copy): the GPT-2 bf16 graph's GeluGrad is (True, True, True)
_KINDS = [(d, x, c) for d in (True, False) for x in (True, False) for c in (True, False)]


def _wide(a):
    """float64 of a float32 array or of bfloat16 bits."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _gelu_grad64(dy, x, approximate):
    """(dy * GELU'(x), |dy| (|a| + |b|)) in float64, written independently of
    the kernels, GELU'(x) = a + b: the kernels add a and b in float32, so
    their error is relative to |a| + |b| (where the two cancel, near x =
    -0.75, and in the far negative tail, relative to GELU'(x) it is not)."""
    import math
    erfc = np.vectorize(math.erfc)
    if approximate == "tanh":   # 0.5 (1 + tanh u) = s, 1 - tanh^2 u = 4 s (1 - s): no cancelling
        k = np.sqrt(2.0 / np.pi)
        u = k * (x + 0.044715 * x ** 3)
        with np.errstate(over="ignore"):
            s, r = 1 / (1 + np.exp(-2 * u)), 1 / (1 + np.exp(2 * u))
        a, b = s, 2 * x * s * r * k * (1 + 3 * 0.044715 * x * x)
        # the kernel's float32 u carries |u| ulp of error, which exp(-2u)
        # multiplies by |2u| in the tails: PyTorch's float32 form as well
        return dy * (a + b), np.abs(dy) * (np.abs(a) + np.abs(b)) * (1 + np.abs(u))
    else:   # Phi(x) = erfc(-x / sqrt 2) / 2, accurate in the negative tail
        a = 0.5 * erfc(-x / np.sqrt(2.0))
        b = x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)
    return dy * (a + b), np.abs(dy) * (np.abs(a) + np.abs(b))


def _canonical(bits, dtype):
    """The bits, every NaN as one (the host build's NaN sign depends on the
    order g++ gives a product's operands; a GPU writes one canonical NaN)."""
    bits = np.array(bits)
    if dtype == np.uint16:
        nan = np.isnan((bits.astype(np.uint32) << 16).view(np.float32))
    else:
        nan = np.isnan(bits.view(dtype))
    bits[nan] = 0x7fc0 if dtype == np.uint16 else 0x7fc00000
    return bits


def _run(device, dy, x, approximate, copy, layout, fused, round_to=None):
    """(dx bits, copy, db bits, launched) of one call."""
    offset = 1 if layout == "off" else 0
    rows, cols = x.shape
    dyd, xd = _placed(device, dy, offset), _placed(device, x, offset)
    if layout == "in_place" and dy.dtype == np.float32:
        out = dyd
    else:
        out = _placed(device, np.zeros((rows, cols), np.float32), offset)
    cp = None
    if copy:
        cp = xd if layout == "in_place" and x.dtype == np.uint16 else \
            _placed(device, np.zeros((rows, cols), np.uint16), offset)
    db = device.to_device(np.full(cols, np.nan, np.float32))
    (size,), _ = kernels.bias_grad_scratch((rows, cols))
    partial = device.to_device(np.full(size, np.nan))
    device.launched.clear()
    if fused is None:   # the two kernels of the unfused graph
        kernels.gelu_backward(dyd, xd, approximate, out=out, round_to=round_to, copy=cp)
        kernels.sum_rows(out, db, partial=partial)
    else:
        kernels.gelu_backward_bias_grad(dyd, xd, approximate, out, db, round_to=round_to,
                                        copy=cp, partial=partial, fused=fused)
    return (_host(device, out).view(np.uint32), _host(device, cp) if copy else None,
            _host(device, db), list(device.launched))


@pytest.mark.parametrize("dy_bits,x_bits,copy", _KINDS)
# (333, 40): the rows in 2 ranges (bias_grad_splits; 1000 rows took 7) of
# 166 and 167 rows, neither a multiple of the 8 row lanes, then the finish;
# (61, 132) a tile and a 4-column tail, one range; (9, 6) the fallback
@pytest.mark.parametrize("shape", [(333, 40), (61, 132), (9, 6)])
@pytest.mark.parametrize("layout", ["aligned", "off", "in_place"])
def test_fused_is_the_two_kernels_bit_for_bit(device, dy_bits, x_bits, copy, shape, layout):
    approximate = "tanh" if dy_bits != x_bits else "none"   # both forms, half the cases
    rng = np.random.default_rng(shape[0] * 7 + shape[1] + 4 * dy_bits + 2 * x_bits + copy)
    n = shape[0] * shape[1]
    with np.errstate(over="ignore", invalid="ignore"):
        dy = (_special(rng, n) * 10.0 ** rng.integers(-6, 6, size=n)).astype(np.float32)
    x = _special(rng, n)
    dy = (_bf16_bits(dy) if dy_bits else dy).reshape(shape)
    x = (_bf16_bits(x) if x_bits else x).reshape(shape)
    round_to = "bfloat16" if shape == (61, 132) else None
    old = _run(device, dy, x, approximate, copy, layout, None, round_to)
    new = _run(device, dy, x, approximate, copy, layout, True, round_to)
    f32 = np.float32
    np.testing.assert_array_equal(_canonical(new[0], f32), _canonical(old[0], f32))   # dx
    if copy:
        np.testing.assert_array_equal(_canonical(new[1], np.uint16),
                                      _canonical(old[1], np.uint16))
    np.testing.assert_array_equal(_canonical(new[2].view(np.uint32), f32),
                                  _canonical(old[2].view(np.uint32), f32))   # db
    fused = shape[1] % 4 == 0 and layout != "off"
    name = "gelu_backward" + "_bdy" * dy_bits + "_bx" * x_bits + "_copy" * copy + "_colsum_f32"
    assert (new[3][0] == name) == fused, new[3]
    if fused:   # one pass, then the finish where the rows are split
        assert new[3][1:] in ([], ["bias_grad_finish"])
        assert len(new[3]) == 1 + (kernels.elementwise.bias_grad_splits(*shape, 1) > 1)
    else:
        assert new[3] == old[3]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(1000, 40), (257, 128), (33, 12)])
def test_db_against_a_float64_reference(device, approximate, shape):
    """db = sum over rows of dy GELU'(x), in float64 from the same bf16
    inputs. Tolerance: |db - ref| <= 8 float32 ulp (2^-24 each) of the sum
    over rows of |dy| (|a| + |b|) (GELU'(x) = a + b, added in float32 by
    the kernel: each dx within a few ulp of that size; the rows are then
    added in double, which adds nothing at this scale) plus one ulp of |ref|
    (db's rounding to float32); each dx within 8 ulp of its |dy| (|a| + |b|).
    The tanh form's size is times (1 + |u|): the float32 u's rounding,
    amplified by exp(-2u) in the tails. Plus 2^-140 an element: where a
    dx is below float32's normal range (x < -10) its steps are 2^-149 and
    the kernel's intermediates there are subnormal too."""
    rng = np.random.default_rng(shape[0] + shape[1])
    dy = _bf16_bits(rng.standard_normal(shape).astype(np.float32))
    x = _bf16_bits((3 * rng.standard_normal(shape)).astype(np.float32))
    dx64, size = _gelu_grad64(_wide(dy), _wide(x), approximate)
    want = dx64.sum(axis=0)
    got = _run(device, dy, x, approximate, True, "aligned", True)
    db = got[2].astype(np.float64)
    ulp = 2.0 ** -24
    tiny = 2.0 ** -140   # float32's subnormal range: 512 of its smallest steps
    bound = 8 * ulp * size.sum(axis=0) + ulp * np.abs(want) + shape[0] * tiny
    assert np.all(np.abs(db - want) <= bound), np.max(np.abs(db - want) / bound)
    # and dx itself against the reference, element by element
    dx = got[0].view(np.float32).astype(np.float64)
    assert np.all(np.abs(dx - dx64) <= 8 * ulp * size + tiny), \
        np.max(np.abs(dx - dx64) / (8 * ulp * size + tiny))


def test_the_check_can_fail(device):
    """A db off by one float32 ulp in one column is outside the bitwise
    check above (the comparison is of bits, not of values near)."""
    rng = np.random.default_rng(5)
    dy = _bf16_bits(rng.standard_normal((40, 8)).astype(np.float32))
    x = _bf16_bits(rng.standard_normal((40, 8)).astype(np.float32))
    old = _run(device, dy, x, "none", True, "aligned", None)
    bumped = old[2].copy()
    bumped[3] = np.nextafter(bumped[3], np.float32(np.inf))
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(bumped.view(np.uint32), old[2].view(np.uint32))


def test_bad_arguments_say_what(device):
    dy = device.to_device(np.zeros((4, 8), np.float32))
    out = device.to_device(np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="db must be"):
        kernels.gelu_backward_bias_grad(dy, dy, "none", out, device.to_device(
            np.zeros(7, np.float32)))
    with pytest.raises(ValueError, match="2-D float32 out"):
        kernels.gelu_backward_bias_grad(dy, dy, "none", out.reshape(-1),
                                        device.to_device(np.zeros(8, np.float32)))


def test_in_whole_blocks_of_256_threads_the_partials_are_sum_rows_vec(host_build_dir):
    """The host-compiled kernel on blocks of the GPU's 256 threads (32 lanes
    of four columns x 8 row lanes), 3 blocks (the grid-stride loop over the
    jobs): its dx is the _vec kernel's and its partial sums and db those of
    sum_rows_vec_f32 over that dx, bit for bit."""
    import ctypes

    from purine_mpi.gpu import kernel_source
    from purine_mpi.gpu.kernels.base import _REDUCE_THREADS
    from purine_mpi.gpu.kernels.elementwise import bias_grad_splits
    from tests.emulated_gpu.host_kernels import host_cupy
    cupy = host_cupy(host_build_dir)
    act = cupy.RawModule(code=kernel_source("activation"))
    reduce = cupy.RawModule(code=kernel_source("reduce"))

    def run(kernel, args):
        if kernel._fiber_grid is None:
            pytest.skip("the emulator runs blocks as fibers only where <ucontext.h> is")
        c_args = [kernel._convert(i, a, p) for i, (a, p) in enumerate(zip(args, kernel.params))]
        kernel._fiber_grid(ctypes.c_uint(3), ctypes.c_uint(_REDUCE_THREADS), *c_args)

    rng = np.random.default_rng(13)
    for shape in [(1000, 40), (2053, 4), (5, 260), (64, 512)]:
        rows, cols = shape
        splits = bias_grad_splits(rows, cols, 1)
        (size,), _ = kernels.bias_grad_scratch(shape)
        dy = _bf16_bits((rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, size=shape))
                        .astype(np.float32))
        x = _bf16_bits((3 * rng.standard_normal(shape)).astype(np.float32))
        dx = np.zeros(shape, np.float32)
        copy = np.zeros(shape, np.uint16)
        db = np.full(cols, np.nan, np.float32)
        partial = np.full(size, np.nan)
        run(act.get_function("gelu_backward_bdy_bx_copy_colsum_f32"),
            (np.int64(cols), dy, x, np.int64(rows), np.int64(splits), np.int32(0), np.int32(0),
             dx, copy, partial, db))
        dx_old = np.zeros(shape, np.float32)
        copy_old = np.zeros(shape, np.uint16)
        run(act.get_function("gelu_backward_bdy_bx_copy_vec_f32"),
            (np.int64(rows * cols), dy, x, np.int32(0), np.int32(0), dx_old, copy_old))
        db_old = np.full(cols, np.nan, np.float32)
        partial_old = np.full(size, np.nan)
        run(reduce.get_function("sum_rows_vec_f32"),
            (np.int64(cols), dx_old, np.int64(rows), np.int64(splits), np.int32(0),
             partial_old, db_old))
        np.testing.assert_array_equal(dx.view(np.uint32), dx_old.view(np.uint32))
        np.testing.assert_array_equal(copy, copy_old)
        if splits > 1:
            np.testing.assert_array_equal(partial.view(np.uint64), partial_old.view(np.uint64))
        else:
            np.testing.assert_array_equal(db.view(np.uint32), db_old.view(np.uint32))


# ------------------------------------------------------- the op and the pass

def _op_case(rng, rows, cols, dy_bits, x_bits):
    dy = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-4, 4, (rows, cols)))
    x = 3 * rng.standard_normal((rows, cols))
    dy, x = dy.astype(np.float32), x.astype(np.float32)
    return (_bf16_bits(dy) if dy_bits else dy), (_bf16_bits(x) if x_bits else x)


@pytest.mark.parametrize("dy_bits,x_bits,copy", [(True, True, True), (False, False, False),
                                                 (False, True, True)])
@pytest.mark.parametrize("shape", [(16, 64), (5, 3, 24), (7, 6)])
def test_the_op_with_bias_grad_is_geluGrad_then_the_bias_gradient(device, dy_bits, x_bits, copy,
                                                                  shape):
    """GeluGrad with ``bias_grad`` (db its last output) against GeluGrad and
    InnerProductGradBias, on the device (one launch where the width is a
    multiple of 4, plus the finish where the rows are split) and on the
    host: dx, its copy and db bit for bit."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.registry import make_kernel
    rng = np.random.default_rng(sum(shape) + dy_bits + 2 * x_bits)
    rows = int(np.prod(shape[:-1]))
    dy, x = _op_case(rng, rows, shape[-1], dy_bits, x_bits)
    dy, x = dy.reshape(shape), x.reshape(shape)
    attrs = dict({"approximate": "tanh"}, **({"bits_copy": [0], "bits_out": [1]} if copy else {}))
    outs = ["dx", "copy"] if copy else ["dx"]
    fused = make_kernel(Op("g", "GeluGrad", ["dy", "x"], outs + ["db"],
                           dict(attrs, bias_grad=True)))
    plain = make_kernel(Op("g", "GeluGrad", ["dy", "x"], outs, dict(attrs)))
    bias = make_kernel(Op("b", "InnerProductGradBias", ["dx"], ["db"], {}))

    def arrays(put):
        o = [put(np.zeros(shape, np.float32))]
        if copy:
            o.append(put(np.zeros(shape, np.uint16)))
        return [put(dy), put(x)], o, put(np.full(shape[-1], np.nan, np.float32))

    for put, get, launched in ((device.to_device, lambda a: np.array(device.to_host(a)), True),
                               (np.array, np.asarray, False)):
        ins, o, db = arrays(put)
        fused.setup(ins, o + [db])
        device.launched.clear()
        fused.run(ins, o + [db])
        new = [get(a) for a in o + [db]]
        got = list(device.launched)
        ins, o, db = arrays(put)
        plain.setup(ins, o)
        bias.setup([o[0]], [db])
        plain.run(ins, o)
        bias.run([o[0]], [db])
        old = [get(a) for a in o + [db]]
        for a, b in zip(new, old):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        if launched and shape[-1] % 4 == 0:
            name = "gelu_backward" + "_bdy" * dy_bits + "_bx" * x_bits + "_copy" * copy + \
                "_colsum_f32"
            assert got[0] == name and "sum_rows_vec_f32" not in got, got


def _gpt_graph(monkeypatch, host_build_dir, fold, precision="bf16"):
    from tests.test_bf16_storage import _gpt
    monkeypatch.setenv("PURINE_GELU_BIAS_GRAD", "1" if fold else "0")
    return _gpt(monkeypatch, host_build_dir, precision=precision)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_pass_folds_the_mlp_fc_bias_gradient_only(host_build_dir, monkeypatch, precision):
    """In the 2-block GPT with PURINE_GELU_BIAS_GRAD=1: each block's MLP fc
    bias gradient (the one that read GeluGrad's dx) is gone, its db the
    GeluGrad's last output; every other bias gradient (qkv, the
    projections) stays; nothing changes with the variable off (the
    default)."""
    off = _gpt_graph(monkeypatch, host_build_dir, False, precision)
    on = _gpt_graph(monkeypatch, host_build_dir, True, precision)
    prod_off = off.producers()
    bias_off = {op.outputs[0]: op.inputs[0] for op in off.ops.values()
                if op.op_type == "InnerProductGradBias"}
    of_gelu = {db for db, dx in bias_off.items() if prod_off[dx][0].op_type == "GeluGrad"}
    assert len(of_gelu) == 2   # one a block
    assert not any(op.attrs.get("bias_grad") for op in off.ops.values())
    bias_on = {op.outputs[0] for op in on.ops.values() if op.op_type == "InnerProductGradBias"}
    assert bias_on == set(bias_off) - of_gelu
    prod_on = on.producers()
    for db in of_gelu:
        (g,) = prod_on[db]
        assert g.op_type == "GeluGrad" and g.attrs["bias_grad"] and g.outputs[-1] == db
        assert on.blobs[db].dtype == "float32"
        assert len(g.outputs) == (3 if precision == "bf16" else 2)
    assert len(on.ops) == len(off.ops) - 2


def test_the_pass_leaves_other_patterns(host_build_dir, monkeypatch):
    """A GeluGrad whose dx an InnerProductGradBias sums, but whose x is not
    an fc output (a Gelu of a graph input), and an accumulating bias
    gradient, are not folded."""
    from purine_mpi.graph.core import Graph
    from purine_mpi.parallel.fuse import fold_gelu_bias_grads
    def graph(x_from_fc, accumulate):
        g = Graph()
        for name, shape in (("a", (4, 8)), ("w", (8, 8)), ("b", (8,)), ("x", (4, 8)),
                            ("dy", (4, 8)), ("dx", (4, 8)), ("db", (8,))):
            g.add_blob(name, shape)
        if x_from_fc:
            g.add_op("fc", "InnerProduct", ["a", "w", "b"], ["x"], {})
        g.add_op("gg", "GeluGrad", ["dy", "x"], ["dx"], {"approximate": "none"})
        g.add_op("gb", "InnerProductGradBias", ["dx"], ["db"], {}, accumulate=accumulate)
        return g

    for x_from_fc, accumulate in ((False, False), (True, True)):
        g = graph(x_from_fc, accumulate)
        assert fold_gelu_bias_grads(g) == []
        assert "gb" in g.ops and not g.ops["gg"].attrs.get("bias_grad")
    g = graph(True, False)   # and the pattern itself is folded
    assert fold_gelu_bias_grads(g) == ["gb"]
    assert g.ops["gg"].outputs == ["dx", "db"] and g.ops["gg"].attrs["bias_grad"]


def test_a_bf16_gpt_trains_bitwise_the_same_with_the_fold(host_build_dir, monkeypatch):
    """Three captured AdamW steps of the 2-block bf16 GPT on the emulated
    device: the losses and every weight bit for bit the same with
    PURINE_GELU_BIAS_GRAD=1 as without, the fused kernel launched in place
    of each GELU backward kernel and one column-sum launch fewer for each."""
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER
    runs = {}
    for fold in ("1", "0"):
        with monkeypatch.context() as m:
            m.setenv("PURINE_GELU_BIAS_GRAD", fold)
            use_emulated_cupy(m, host_build_dir)
            runs[fold] = bf16_gpt_steps(m, SOLVER, 3, 2, cuda_graph=True)
    on, off = runs["1"], runs["0"]
    assert on[0] == off[0] and on[0][-1] != on[0][0]
    assert sorted(on[1]) == sorted(off[1])
    for name in on[1]:
        np.testing.assert_array_equal(on[1][name].view(np.uint32), off[1][name].view(np.uint32),
                                      err_msg=name)
    first_on, first_off = on[2][0], off[2][0]
    gelu = first_off["gelu_backward_bdy_bx_copy_vec_f32"]   # a block's, counted as launched
    assert gelu > 0 and gelu % 2 == 0
    assert first_on["gelu_backward_bdy_bx_copy_colsum_f32"] == gelu
    assert first_on.get("gelu_backward_bdy_bx_copy_vec_f32", 0) == 0
    assert first_off.get("gelu_backward_bdy_bx_copy_colsum_f32", 0) == 0
    sums = ("sum_rows_vec_f32", "sum_rows_f32", "sum_rows_bits_vec_f32", "sum_rows_bits_f32")
    assert sum(first_on.get(f, 0) for f in sums) == sum(first_off.get(f, 0) for f in sums) - gelu


@pytest.mark.parametrize("compose", ["data", "micro"])
def test_the_pass_folds_into_a_gradient_that_is_a_view(host_build_dir, monkeypatch, compose):
    """The fc bias gradient as a view: data parallelism makes every gradient
    a view of its flat bucket (compose_data_parallel, before the device's
    fusions), micro-batches make copy 0's a view of the gradient the update
    reads (``_sum_in_place``). GeluGrad writes db there as the
    InnerProductGradBias it replaces did (a contiguous range), so the fold
    still fires: each block's MLP fc bias gradient, db still the view."""
    from purine_mpi.parallel.data_parallel import compose_data_parallel
    from purine_mpi.parallel.micro_batch import micro_name, replicate_micro_batches
    from purine_mpi.parallel.placement import prepare_for_device
    from tests.emulated_gpu import use_emulated_cupy
    from tests.gpt_oracle import gpt_graph, gpt_net
    from tests.test_precision import SOLVER
    use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setenv("PURINE_GELU_BIAS_GRAD", "1")
    net = gpt_net(vocab=16, width=16, heads=2, blocks=2, max_length=8, approximate="tanh")
    g, grads, _ = gpt_graph(net, dict(SOLVER, max_iter=3), 2, 8)
    if compose == "data":
        compose_data_parallel(g, grads, 2, 0)
    else:
        replicate_micro_batches(g, grads, 2, in_place=True)
    prepare_for_device(g, 0, precision="fp32")
    folded = [op for op in g.ops.values() if op.attrs.get("bias_grad")]
    per_copy = 1 if compose == "data" else 2
    assert len(folded) == 2 * per_copy, [op.name for op in folded]
    views = [op.outputs[-1] for op in folded if g.blobs[op.outputs[-1]].alias_of]
    assert len(views) == 2, views   # the buckets' views; copy 0's of the gradients
    if compose == "micro":
        assert all(v.endswith(micro_name("", 0)) for v in views), views
    prod = g.producers()
    assert all(prod[v] == [op] for op in folded for v in op.outputs[-1:])
    assert not any(op.op_type == "InnerProductGradBias" and op.inputs[0] in
                   {f.outputs[0] for f in folded} for op in g.ops.values())


@pytest.mark.parametrize("micro,precision", [(2, "fp32"), (1, "fp16")])
def test_micro_batches_train_bitwise_the_same_with_the_fold(host_build_dir, monkeypatch,
                                                            tmp_path, micro, precision):
    """The trainer on the emulated device (CUDA graphs), the 2-block GPT,
    3 iterations: with PURINE_GELU_BIAS_GRAD=1 every copy's MLP fc bias
    gradient is folded -- at 2 micro-batches copy 0's db a view of the
    gradient the running sums add to in place; in fp16 db viewed by the
    loss scale's Unscale, which writes its ``@unscale`` view in place --
    and the losses and weights are those without it bit for bit."""
    import json

    from purine_mpi.base.backend import to_numpy
    from purine_mpi.job.config import validate_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu import emulated_trainer_env
    from tests.gpt_nets import gpt_config, text_h5
    emulated_trainer_env(monkeypatch, host_build_dir)
    data = text_h5(tmp_path)

    def train(fold):
        monkeypatch.setenv("PURINE_GELU_BIAS_GRAD", fold)
        raw = gpt_config(data, layers=2, width=16, heads=2, length=8, batch=4, iters=3,
                         parallel={"micro_batches": micro})
        raw.update(device=0, precision=precision, cuda_graph=True)
        raw["data"].pop("test")
        out = tmp_path / f"fold{fold}{micro}{precision}"
        t = Trainer(make_job(validate_config(raw, check_files=False)), str(out),
                    world=FakeWorld(), log=lambda line: None)
        graph = t.graphs.graph
        folded = [op for op in graph.ops.values() if op.attrs.get("bias_grad")]
        views = [op for op in folded if graph.blobs[op.outputs[-1]].alias_of or
                 any(b.alias_of == op.outputs[-1] for b in graph.blobs.values())]
        assert run_and_report(t, FakeWorld()) == 0
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in rows if r["phase"] == "train"]
        weights = {p: np.array(to_numpy(t.train.workspace[p])) for p in t.graphs.params}
        return losses, weights, len(folded), len(views)

    on, off = train("1"), train("0")
    assert on[2:] == ((4, 2) if micro == 2 else (2, 2)) and off[2:] == (0, 0), (on[2:], off[2:])
    assert len(on[0]) == 3 and on[0] == off[0]
    for name in off[1]:
        np.testing.assert_array_equal(on[1][name].view(np.uint32), off[1][name].view(np.uint32),
                                      err_msg=name)
