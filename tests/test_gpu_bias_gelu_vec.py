"""The vectorised bias and GELU kernels (cuda/activation.cu
``bias_bits_vec_f32``, ``gelu_forward_bx_bits_vec_f32``, the
``gelu_backward_..._vec_f32`` entry points: 8 elements a thread, 16-byte
loads and stores) against the one-element kernels before them, bit for bit,
and ``bias_bits`` against a NumPy reference: sizes not multiples of 8 (a
scalar tail), bases off the 16-byte grid (the launcher falls back to the
old kernel), in place, NaN / inf / ties to even / signed zeros / both GELU
forms / the rounding modes. On the emulated device (blocks of 3 threads:
every grid-stride step, the tail) and on a GPU when there is one."""
import numpy as np
import pytest

from purine_mpi.gpu import kernels


def _bf16_bits(values):
    """The bits of the bfloat16 nearest each float32 (ties to even; NaN and
    inf kept): an independent NumPy reference of purine_round_bf16."""
    b = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    special = (b & 0x7f800000) == 0x7f800000
    rounded = (b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000
    return (np.where(special, b, rounded) >> 16).astype(np.uint16)


def _special(rng, n):
    """n float32 values: normal ones, then NaN, +-inf, +-0, ties to even,
    huge ones that round to inf, tiny ones."""
    x = (4 * rng.standard_normal(n)).astype(np.float32)
    tie = np.array([0x3f808000, 0x3f818000, 0xbf808000, 0x7f7f8000], np.uint32).view(np.float32)
    extra = np.concatenate([[np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38, -3e38, 1e-40, 17.0, -17.0,
                             6.0, -6.0], tie]).astype(np.float32)
    x[:min(n, extra.size)] = extra[:min(n, extra.size)]
    return rng.permutation(x)


def _placed(device, x, offset):
    """x on the device ``offset`` elements into a larger buffer (off the
    16-byte grid for offset 1)."""
    flat = np.zeros(x.size + offset, x.dtype)
    flat[offset:] = x.ravel()
    return device.to_device(flat)[offset:].reshape(x.shape)


def _host(device, a):
    return np.array(device.to_host(a))


@pytest.mark.parametrize("channels", [8, 24, 40, 56, 12])
@pytest.mark.parametrize("offset", [0, 1])
def test_bias_bits_vec_is_the_reference_and_the_old_kernel(device, channels, offset):
    rng = np.random.default_rng(channels + offset)
    rows = 7
    src = _special(rng, rows * channels).reshape(rows, channels)
    bias = (rng.standard_normal(channels)).astype(np.float32)
    bias[1] = -src[0, 1] if np.isfinite(src[0, 1]) else 0.0   # a sum of exactly 0
    want = _bf16_bits(src + bias)   # float32 sum, then rounded once
    got = {}
    for vec in (True, False):
        s, b = _placed(device, src, offset), _placed(device, bias, offset)
        out = _placed(device, np.zeros(src.shape, np.uint16), offset)
        device.launched.clear()
        kernels.bias_bits(s, b, out, vec=vec)
        got[vec] = _host(device, out)
        expect_vec = vec and offset == 0 and channels % 8 == 0
        assert device.launched == ["bias_bits_vec_f32" if expect_vec else "bias_bits_f32"]
    np.testing.assert_array_equal(got[True], want)
    np.testing.assert_array_equal(got[False], want)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("size", [64, 61, 1003])
@pytest.mark.parametrize("layout", ["aligned", "off", "in_place"])
def test_gelu_forward_bits_vec_is_the_old_kernel(device, approximate, size, layout):
    rng = np.random.default_rng(size)
    x = _bf16_bits(_special(rng, size))
    offset = 1 if layout == "off" else 0
    got = {}
    for vec in (True, False):
        xd = _placed(device, x, offset)
        out = xd if layout == "in_place" else _placed(device, np.zeros_like(x), offset)
        device.launched.clear()
        kernels.gelu_forward_bits(xd, approximate, out, vec=vec)
        name = "gelu_forward_bx_bits_vec_f32" if vec and offset == 0 else \
            "gelu_forward_bx_bits_f32"
        assert device.launched == [name]
        got[vec] = _host(device, out)
    np.testing.assert_array_equal(got[True], got[False])
    # and a plain check that can fail: gelu(x) ~ x Phi(x) to bfloat16 precision
    from math import erf
    xs = x.astype(np.uint32) << 16
    xf = xs.view(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = np.array([v * 0.5 * (1 + erf(v / np.sqrt(2))) if np.isfinite(v) else np.nan
                        for v in xf])
    y = (got[True].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    finite = np.isfinite(ref)
    tol = 2e-2 if approximate == "tanh" else 1e-2   # the tanh form is off by < 1e-3 abs
    np.testing.assert_allclose(y[finite], ref[finite], rtol=tol, atol=2e-3)


# (dy bits, x bits, copy): the launches that take the _f32 entry points (a
# float32 dy without a copy takes gelu_backward(_bx)_f32's own launcher)
_BACKWARD = [(d, x, c) for d in (True, False) for x in (True, False) for c in (True, False)
             if d or c]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dy_bits,x_bits,copy", _BACKWARD)
@pytest.mark.parametrize("size", [64, 61])
@pytest.mark.parametrize("layout", ["aligned", "off", "in_place"])
def test_gelu_backward_vec_is_the_old_kernel(device, approximate, dy_bits, x_bits, copy, size,
                                             layout):
    rng = np.random.default_rng(size + 2 * dy_bits + x_bits)
    dy = _special(rng, size)
    x = _special(rng, size)
    dy = _bf16_bits(dy) if dy_bits else dy
    x = _bf16_bits(x) if x_bits else x
    offset = 1 if layout == "off" else 0
    round_to = "bfloat16" if size == 61 else None
    got = {}
    for vec in (True, False):
        dyd, xd = _placed(device, dy, offset), _placed(device, x, offset)
        if layout == "in_place" and not dy_bits:
            out = dyd   # dx over a float32 dy
        else:
            out = _placed(device, np.zeros(size, np.float32), offset)
        cp = None
        if copy:
            cp = xd if layout == "in_place" and x_bits else \
                _placed(device, np.zeros(size, np.uint16), offset)
        device.launched.clear()
        kernels.gelu_backward(dyd, xd, approximate, out=out, round_to=round_to, copy=cp, vec=vec)
        name = "gelu_backward" + "_bdy" * dy_bits + "_bx" * x_bits + "_copy" * copy + \
            ("_vec_f32" if vec and offset == 0 else "_f32")
        assert device.launched == [name]
        got[vec] = (_host(device, out).view(np.uint32),
                    _host(device, cp) if copy else None)
    np.testing.assert_array_equal(got[True][0], got[False][0])
    if copy:
        np.testing.assert_array_equal(got[True][1], got[False][1])
        np.testing.assert_array_equal(got[True][1], _bf16_bits(got[True][0].view(np.float32)))


# ------------------------------------------------- column sums (sum_rows) ---

def _spread32(rng, shape):
    """float32 values over 16 decades: their double sums' bits depend on the order."""
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 8, size=shape)).astype(
        np.float32)


@pytest.mark.parametrize("shape", [(1000, 40), (2053, 4), (5, 132), (300, 12), (7, 6)])
@pytest.mark.parametrize("bits", [False, True])
@pytest.mark.parametrize("offset", [0, 1])
def test_sum_rows_vec_is_the_old_kernel_and_its_order(device, shape, bits, offset):
    """sum_rows_(bits_)vec_f32 (four columns a thread) against sum_rows_f32
    / sum_rows_bits_f32: the same partial sums (doubles, in the scratch) and
    the same float32 sums, bit for bit, and the model of their order
    (tests/test_gpu_column_sum.py); cols not a multiple of 4 or a base off
    the grid take the old kernel."""
    from purine_mpi.gpu.kernels.base import _REDUCE_THREADS
    from tests.emulated_gpu.host_kernels import _EMU_THREADS
    from tests.test_gpu_column_sum import model
    rng = np.random.default_rng(shape[0] + shape[1] + bits)
    x = _spread32(rng, shape)
    if bits:
        x = _bf16_bits(x)
    wide = ((x.astype(np.uint32) << 16).view(np.float32) if bits else x).astype(np.float64)
    start = _spread32(rng, shape[1])
    (size,), _ = kernels.bias_grad_scratch(shape)
    threads = _REDUCE_THREADS if device.name == "cupy" else _EMU_THREADS
    for accumulate in (False, True):
        got = {}
        for vec in (True, False):
            out = device.to_device(start.copy())
            partial = device.to_device(np.full(size, np.nan))
            device.launched.clear()
            kernels.sum_rows(_placed(device, x, offset), out, accumulate=accumulate,
                             partial=partial, vec=vec)
            name = "sum_rows" + "_bits" * bits + \
                ("_vec_f32" if vec and offset == 0 and shape[1] % 4 == 0 else
                 "_f32" if bits else "")
            assert device.launched[0] == name
            got[vec] = (_host(device, out), _host(device, partial))
        np.testing.assert_array_equal(got[True][0].view(np.uint32), got[False][0].view(np.uint32))
        np.testing.assert_array_equal(got[True][1].view(np.uint64), got[False][1].view(np.uint64))
        want = model(wide, threads, start.astype(np.float64) if accumulate else None)
        np.testing.assert_array_equal(got[True][0], want.astype(np.float32))


def test_sum_rows_vec_in_whole_blocks_of_256_threads_has_the_old_bits(host_build_dir):
    """The host-compiled kernels on blocks of the GPU's 256 threads (32 lanes
    of four columns x 8 row lanes: the tree over the row lanes), 3 blocks
    (the grid-stride loop over the jobs): the old kernel's partial sums."""
    import ctypes

    from purine_mpi.gpu import kernel_source
    from purine_mpi.gpu.kernels.base import _REDUCE_THREADS
    from purine_mpi.gpu.kernels.elementwise import bias_grad_splits
    from tests.emulated_gpu.host_kernels import host_cupy
    cupy = host_cupy(host_build_dir)
    reduce = cupy.RawModule(code=kernel_source("reduce"))
    rng = np.random.default_rng(11)
    for shape in [(1000, 40), (2053, 4), (5, 260)]:
        rows, cols = shape
        splits = bias_grad_splits(rows, cols, 1)
        x = _spread32(rng, shape)
        got = []
        for func in ("sum_rows_f32", "sum_rows_vec_f32"):
            kernel = reduce.get_function(func)
            if kernel._fiber_grid is None:
                pytest.skip("the emulator runs blocks as fibers only where <ucontext.h> is")
            out = np.zeros(cols, np.float32)
            partial = np.full(kernels.bias_grad_scratch(shape)[0], np.nan)
            args = (np.int64(cols), x, np.int64(rows), np.int64(splits), np.int32(0),
                    partial, out)
            c_args = [kernel._convert(i, a, p) for i, (a, p) in
                      enumerate(zip(args, kernel.params))]
            kernel._fiber_grid(ctypes.c_uint(3), ctypes.c_uint(_REDUCE_THREADS), *c_args)
            got.append((out, partial))
        np.testing.assert_array_equal(got[0][1].view(np.uint64), got[1][1].view(np.uint64))
        np.testing.assert_array_equal(got[0][0].view(np.uint32), got[1][0].view(np.uint32))
