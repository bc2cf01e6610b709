"""Layer norm's backward with its weight and bias gradients' column sums
in the same pass (cuda/layernorm.cu ``layernorm_backward[_bdy][_copy]_
colsum_f32`` + reduce.cu ``bias_grad_finish_f32``: ``kernels.
layernorm_backward_sums``), against today's warp-per-row kernel
(``layernorm_backward``) and the column sums after it: dx and its bits copy
bit for bit; dg and db against a float64 NumPy reference (tolerance in
``test_dg_db_against_a_float64_reference``). On the emulated device and on
a GPU when there is one (``gpu``)."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels
from tests.test_gpu_bias_gelu_vec import _bf16_bits, _host, _placed


def _inputs(rng, rows, cols, dy_bits):
    x = (rng.standard_normal((rows, cols)) * 3 + 0.5).astype(np.float32)
    g = rng.standard_normal(cols).astype(np.float32)
    mean = x.mean(axis=1).astype(np.float32)
    rstd = (1 / np.sqrt(x.var(axis=1) + 1e-5)).astype(np.float32)
    dy = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-3, 3, (rows, cols)))
    dy = dy.astype(np.float32)
    return (_bf16_bits(dy) if dy_bits else dy), x, g, mean, rstd


def _wide(a):
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _new(device, dy, x, g, mean, rstd, copy, offset=0, with_dx=True):
    rows, cols = x.shape
    put = [_placed(device, a, offset) for a in (dy, x, g, mean, rstd)]
    dx = _placed(device, np.zeros((rows, cols), np.float32), offset) if with_dx else None
    cp = _placed(device, np.zeros((rows, cols), np.uint16), offset) if copy else None
    dg = device.to_device(np.full(cols, np.nan, np.float32))
    db = device.to_device(np.full(cols, np.nan, np.float32))
    (size,), _ = kernels.layernorm_sums_scratch(x.shape)
    partial = device.to_device(np.full(size, np.nan))
    device.launched.clear()
    kernels.layernorm_backward_sums(*put, dx, dg, db, copy=cp, partial=partial)
    launched = list(device.launched)
    return (None if dx is None else _host(device, dx), None if cp is None else _host(device, cp),
            _host(device, dg), _host(device, db), launched)


def _old(device, dy, x, g, mean, rstd, copy):
    rows, cols = x.shape
    put = [device.to_device(a) for a in (dy, x, g, mean, rstd)]
    dx = device.to_device(np.zeros((rows, cols), np.float32))
    dyxhat = device.to_device(np.zeros((rows, cols), np.float32))
    cp = device.to_device(np.zeros((rows, cols), np.uint16)) if copy else None
    dg = device.to_device(np.zeros(cols, np.float32))
    db = device.to_device(np.zeros(cols, np.float32))
    kernels.sum_rows(put[0], db)
    kernels.layernorm_backward(*put, dx=dx, dyxhat=dyxhat, copy=cp)
    kernels.sum_rows(dyxhat, dg)
    return (_host(device, dx), None if cp is None else _host(device, cp), _host(device, dg),
            _host(device, db))


def _reference(dy, x, g, mean, rstd):
    """(dg, db, and the sums of |terms| each has) in float64 from the same
    float32 / bf16 inputs, the statistics as given."""
    d = _wide(dy)
    xhat = (x.astype(np.float64) - mean.astype(np.float64)[:, None]) * \
        rstd.astype(np.float64)[:, None]
    return (d * xhat).sum(0), d.sum(0), np.abs(d * xhat).sum(0), np.abs(d).sum(0)


@pytest.mark.parametrize("dy_bits,copy", [(True, True), (False, False), (False, True),
                                          (True, False)])
# 76 rows: 3 jobs of 8 warps x 4 rows (LN_SUM_ROWS), the fourth pass over
# the warps 4 rows and 20 empty warps: the multi-block, grid-stride and tail
# paths the 300 rows of earlier took (10 jobs: a last pass of 60 rows, 20 empty
# warps)
@pytest.mark.parametrize("shape", [(76, 64), (37, 768), (5, 12), (70, 640)])
def test_dx_is_todays_kernels_bit_for_bit(device, dy_bits, copy, shape):
    rng = np.random.default_rng(shape[0] + shape[1] + 2 * dy_bits + copy)
    args = _inputs(rng, *shape, dy_bits)
    new = _new(device, *args, copy)
    old = _old(device, *args, copy)
    np.testing.assert_array_equal(new[0].view(np.uint32), old[0].view(np.uint32))
    if copy:
        np.testing.assert_array_equal(new[1], old[1])
    name = "layernorm_backward" + "_bdy" * dy_bits + "_copy" * copy + "_colsum_f32"
    assert new[4] == [name, "bias_grad_finish", "bias_grad_finish"], new[4]
    # off the 16-byte grid the same lanes read an element at a time: the same bits
    off = _new(device, *args, copy, offset=1)
    for a, b in zip(off[:4], new[:4]):
        if a is not None:
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dy_bits", [False, True])
@pytest.mark.parametrize("shape", [(300, 64), (37, 768), (1000, 16)])
def test_dg_db_against_a_float64_reference(device, dy_bits, shape):
    """Tolerance: |dg - ref| <= 40 float32 ulp (2^-24) of the column's sum
    of |dy xhat| plus one ulp of |ref|. The kernel rounds xhat twice and
    the product once (3 ulp a term) and adds a warp's rows in float32 (at
    most 16 rows a warp on the emulator's two-warp blocks, 4 on a GPU's
    eight: <= 16 ulp), then in double; 40 leaves room. db the same bound of
    sum |dy|. Today's two-kernel path is within the same bound."""
    rng = np.random.default_rng(shape[0] * 3 + dy_bits)
    args = _inputs(rng, *shape, dy_bits)
    ref_dg, ref_db, size_dg, size_db = _reference(*args)
    ulp = 2.0 ** -24
    new = _new(device, *args, True)
    old = _old(device, *args, True)
    for got in (new, old):
        dg, db = got[2].astype(np.float64), got[3].astype(np.float64)
        for value, ref, size in ((dg, ref_dg, size_dg), (db, ref_db, size_db)):
            bound = 40 * ulp * size + ulp * np.abs(ref)
            assert np.all(np.abs(value - ref) <= bound), np.max(np.abs(value - ref) / bound)
    # a check that can fail: dg off by 1e-4 of its size in one column is out
    bad = new[2].astype(np.float64).copy()
    bad[1] += 1e-4 * size_dg[1]
    assert not np.all(np.abs(bad - ref_dg) <= 40 * ulp * size_dg + ulp * np.abs(ref_dg))


def test_without_dx_only_the_sums(device):
    rng = np.random.default_rng(3)
    args = _inputs(rng, 50, 32, False)
    with_dx = _new(device, *args, False)
    without = _new(device, *args, False, with_dx=False)
    np.testing.assert_array_equal(with_dx[2].view(np.uint32), without[2].view(np.uint32))
    np.testing.assert_array_equal(with_dx[3].view(np.uint32), without[3].view(np.uint32))


def test_the_sums_are_the_same_run_to_run(device):
    rng = np.random.default_rng(4)
    args = _inputs(rng, 200, 768, True)
    a, b = _new(device, *args, True), _new(device, *args, True)
    for x, y in zip(a[:4], b[:4]):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_shapes_it_does_not_take_are_refused_in_a_line(device):
    assert kernels.layernorm_sums_ok((4, 768), np.float32)
    assert not kernels.layernorm_sums_ok((4, 770), np.float32)
    assert not kernels.layernorm_sums_ok((4, 772), np.float32)
    assert not kernels.layernorm_sums_ok((4, 1024), np.float32)   # GPT-2 medium: today's path
    assert not kernels.layernorm_sums_ok((4, 768), np.float64)
    x = device.to_device(np.zeros((4, 6), np.float32))
    with pytest.raises(ValueError, match="multiple of 4"):
        kernels.layernorm_backward_sums(x, x, x[0], x[:, 0], x[:, 0], None, x[0], x[0])


# ------------------------------------------------------- the op and the pass

@pytest.mark.parametrize("dy_bits,copy", [(True, True), (False, False)])
@pytest.mark.parametrize("shape", [(16, 64), (3, 5, 24), (7, 6)])
def test_the_op_with_column_sums(device, dy_bits, copy, shape):
    """LayerNormGrad with ``column_sums`` against the op without: dx (and its
    copy) bit for bit, dg and db within the float64 test's bound of each
    other; one backward kernel and the two finishes where the width is a
    multiple of 4, today's launches where not (width 6)."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.registry import make_kernel
    rng = np.random.default_rng(sum(shape) + dy_bits)
    rows = int(np.prod(shape[:-1]))
    dy, x, g, mean, rstd = _inputs(rng, rows, shape[-1], dy_bits)
    dy, x = dy.reshape(shape), x.reshape(shape)
    mean, rstd = mean.reshape(shape[:-1]), rstd.reshape(shape[:-1])
    attrs = dict({"outputs": ["dx", "dg", "db"]},
                 **({"bits_copy": [0], "bits_out": [3]} if copy else {}))
    outs = ["dx", "dg", "db"] + (["copy"] if copy else [])
    got = {}
    for sums in (True, False):
        k = make_kernel(Op("l", "LayerNormGrad", ["dy", "x", "g", "mean", "rstd"], outs,
                           dict(attrs, **({"column_sums": True} if sums else {}))))
        ins = [device.to_device(a) for a in (dy, x, g, mean, rstd)]
        o = [device.to_device(np.zeros(shape, np.float32)),
             device.to_device(np.zeros(shape[-1], np.float32)),
             device.to_device(np.zeros(shape[-1], np.float32))]
        if copy:
            o.append(device.to_device(np.zeros(shape, np.uint16)))
        k.setup(ins, o)
        device.launched.clear()
        k.run(ins, o)
        got[sums] = ([np.array(device.to_host(a)) for a in o], list(device.launched))
    (new, launched), (old, _) = got[True], got[False]
    np.testing.assert_array_equal(new[0].view(np.uint32), old[0].view(np.uint32))
    if copy:
        np.testing.assert_array_equal(new[3], old[3])
    ref_dg, ref_db, size_dg, size_db = _reference(dy.reshape(rows, -1), x.reshape(rows, -1),
                                                  g, mean.reshape(-1), rstd.reshape(-1))
    ulp = 2.0 ** -24
    for value, ref, size in ((new[1], ref_dg, size_dg), (new[2], ref_db, size_db)):
        assert np.all(np.abs(value - ref) <= 40 * ulp * size + ulp * np.abs(ref))
    if shape[-1] % 4 == 0:
        name = "layernorm_backward" + "_bdy" * dy_bits + "_copy" * copy + "_colsum_f32"
        assert launched == [name, "bias_grad_finish", "bias_grad_finish"], launched
    else:
        assert not any(f.endswith("_colsum_f32") for f in launched), launched


def test_the_pass_marks_the_layer_norm_gradients(host_build_dir, monkeypatch):
    """With PURINE_LN_SUMS=1 every LayerNormGrad of the 2-block GPT that
    writes dg and db is marked ``column_sums``; none without (the default)."""
    from tests.test_bf16_storage import _gpt
    marked = {}
    for on in ("1", "0"):
        monkeypatch.setenv("PURINE_LN_SUMS", on)
        g = _gpt(monkeypatch, host_build_dir)
        grads = [op for op in g.ops.values() if op.op_type == "LayerNormGrad"]
        assert len(grads) == 5   # two a block and ln_f
        marked[on] = [op.name for op in grads if op.attrs.get("column_sums")]
    assert len(marked["1"]) == 5 and marked["0"] == []


def test_a_bf16_gpt_trains_alike_with_the_sums_in_the_pass(host_build_dir, monkeypatch):
    """Three captured AdamW steps of the 2-block bf16 GPT on the emulated
    device with PURINE_LN_SUMS=1 and without: the column-sum kernel in
    place of each layer norm backward, and the losses within 1e-4 relative
    (dg and db differ in their last bits: another summation order)."""
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.helpers import bf16_gpt_steps
    from tests.test_precision import SOLVER
    runs = {}
    for on in ("1", "0"):
        with monkeypatch.context() as m:
            m.setenv("PURINE_LN_SUMS", on)
            use_emulated_cupy(m, host_build_dir)
            runs[on] = bf16_gpt_steps(m, SOLVER, 3, 2, cuda_graph=True)
    on, off = runs["1"], runs["0"]
    np.testing.assert_allclose(on[0], off[0], rtol=1e-4)
    assert on[0][-1] != on[0][0]
    first_on, first_off = on[2][0], off[2][0]
    fused = sum(n for f, n in first_on.items() if f.startswith("layernorm_backward") and
                f.endswith("_colsum_f32"))
    before = sum(n for f, n in first_off.items() if f.startswith("layernorm_backward"))
    assert fused == before > 0
    assert not any(f.endswith("_colsum_f32") for f in first_off)
