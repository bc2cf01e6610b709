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
