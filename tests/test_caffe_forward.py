"""A Caffe net imported end to end -- ``convert caffe`` of a prototxt, its
weights from a .caffemodel (tests/test_caffemodel.py's independent wire
encoder), ``predict`` of the test phase -- against a NumPy forward written
from Caffe's layer code: grouped convolution with pad and stride, BatchNorm
(its stored scale factor) + Scale, Pooling's ceil rounding with the last
window dropped where it starts in the padding and AVE's divisor counting
the padding up to H + pad, LRN across channels, Dropout (identity in the
test phase), InnerProduct."""
import h5py
import numpy as np

from .conftest import run_cli_args, run_cli_here
from .test_caffemodel import blob, layer, string

PROTOTXT = """
name: "fwd"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "x.txt" batch_size: 4 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 2 stride: 2 group: 2 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
        lrn_param { local_size: 3 alpha: 0.3 beta: 0.75 k: 2 } }
layer { name: "pool2" type: "Pooling" bottom: "norm1" top: "pool2"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "pool3" type: "Pooling" bottom: "pool2" top: "pool3"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 pad: 1 } }
layer { name: "drop" type: "Dropout" bottom: "pool3" top: "pool3" dropout_param { dropout_ratio: 0.5 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool3" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def conv(x, w, b, pad, stride, group):
    n, c, h, wd = x.shape
    o, cg, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    y = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        for i in range(oh):
            for j in range(ow):
                patch = xp[:, g * cg:(g + 1) * cg, i * stride:i * stride + k, j * stride:j * stride + k]
                y[:, g * og:(g + 1) * og, i, j] = np.einsum("ncab,ocab->no", patch,
                                                             w[g * og:(g + 1) * og])
    return y + b[None, :, None, None]


def caffe_pool(x, kind, k, stride, pad):
    """Caffe's PoolingLayer: ceil rounding, the last window dropped where it
    starts in the padding; AVE divides by the window clipped to H + pad."""
    n, c, h, w = x.shape

    def pooled(size):
        p = int(np.ceil((size + 2 * pad - k) / stride)) + 1
        if pad and (p - 1) * stride >= size + pad:
            p -= 1
        return p
    ph_, pw_ = pooled(h), pooled(w)
    y = np.zeros((n, c, ph_, pw_))
    for i in range(ph_):
        for j in range(pw_):
            hs, ws = i * stride - pad, j * stride - pad
            he, we = min(hs + k, h + pad), min(ws + k, w + pad)
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            win = x[:, :, hs:he, ws:we]
            y[:, :, i, j] = win.max(axis=(2, 3)) if kind == "max" else win.sum(axis=(2, 3)) / size
    return y


def lrn_across(x, size, alpha, beta, k):
    c = x.shape[1]
    r = size // 2
    sq = np.pad(x * x, ((0, 0), (r, r), (0, 0), (0, 0)))
    window = sum(sq[:, i:i + c] for i in range(size))
    return x * (k + alpha / size * window) ** -beta


def _convert(tmp_path, prototxt, data, labels):
    """``convert caffe`` of ``prototxt`` with ``data``/``labels`` as both
    splits of an HDF5 file: ``tmp_path/job.yaml``."""
    with h5py.File(tmp_path / "d.h5", "w") as f:
        for split in ("train", "test"):
            f[f"{split}/data"] = data
            f[f"{split}/label"] = labels
    (tmp_path / "net.prototxt").write_text(prototxt)
    res = run_cli_here("convert", "caffe", tmp_path / "net.prototxt", "--data", tmp_path / "d.h5",
                       "--out", tmp_path / "job.yaml")
    assert res.returncode == 0, res.stderr


def _predict(tmp_path, blobs):
    """``predict --blob`` of each of ``blobs`` with ``tmp_path/w.caffemodel``:
    ({blob: array}, the samples' index)."""
    args = [a for b in blobs for a in ("--blob", b)]
    res = run_cli_args("predict", tmp_path / "job.yaml", "--weights", tmp_path / "w.caffemodel",
                       "--out", tmp_path / "p.h5", *args)
    assert res.returncode == 0, res.stderr
    with h5py.File(tmp_path / "p.h5", "r") as out:
        return {b: out[f"outputs/{b}"][...] for b in blobs}, out["index"][...].tolist()


def _off(got, ref, blobs):
    """The blobs off Caffe's forward by more than 1e-5 of max(1, |ref|)
    (each with its figure); a shape that differs fails at once."""
    off = []
    for b in blobs:
        assert got[b].shape == ref[b].shape, f"{b}: shape {got[b].shape}, Caffe's {ref[b].shape}"
        err = np.max(np.abs(got[b] - ref[b])) / max(1.0, np.max(np.abs(ref[b])))
        if not err < 1e-5:
            off.append(f"{b} {err:.3g}")
    return off


def test_imported_caffe_net_forward_is_caffes(tmp_path):
    rng = np.random.default_rng(7)
    data = rng.standard_normal((6, 4, 9, 9)).astype(np.float32)
    _convert(tmp_path, PROTOTXT, data, rng.integers(0, 3, 6))

    w = {"conv1/w": rng.standard_normal((6, 2, 3, 3)), "conv1/b": rng.standard_normal(6),
         "mean": rng.standard_normal(6), "var": rng.random(6) + 0.5,
         "gamma": rng.standard_normal(6), "beta": rng.standard_normal(6),
         "ip/w": rng.standard_normal((3, 6 * 2 * 2)), "ip/b": rng.standard_normal(3)}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    f = np.float32(3.0)   # Caffe keeps the moving sums with a scale factor
    model = string(1, "fwd")
    model += layer("conv1", "Convolution", ["data"], ["conv1"], [blob(w["conv1/w"]),
                                                                  blob(w["conv1/b"])])
    model += layer("bn1", "BatchNorm", ["conv1"], ["conv1"],
                   [blob(w["mean"] * f), blob(w["var"] * f), blob([f])])
    model += layer("scale1", "Scale", ["conv1"], ["conv1"], [blob(w["gamma"]), blob(w["beta"])])
    model += layer("ip", "InnerProduct", ["pool3"], ["ip"], [blob(w["ip/w"]), blob(w["ip/b"])])
    (tmp_path / "w.caffemodel").write_bytes(model)

    blobs = ("conv1", "pool1", "norm1", "pool2", "pool3", "ip")
    got, index = _predict(tmp_path, blobs)
    assert index == list(range(6))

    x = data.astype(np.float64)
    ref = {}
    y = conv(x, w["conv1/w"].astype(np.float64), w["conv1/b"], pad=2, stride=2, group=2)
    y = (y - (w["mean"] * f / f)[None, :, None, None]) / np.sqrt(
        (w["var"] * f / f)[None, :, None, None] + 1e-5)
    y = y * w["gamma"][None, :, None, None] + w["beta"][None, :, None, None]
    ref["conv1"] = y = np.maximum(y, 0)                         # 6 x 6
    ref["pool1"] = y = caffe_pool(y, "max", 3, 2, 1)             # 4 x 4
    ref["norm1"] = y = lrn_across(y, 3, 0.3, 0.75, 2.0)
    ref["pool2"] = y = caffe_pool(y, "ave", 3, 2, 1)             # 3 x 3, a window into the pad
    ref["pool3"] = y = caffe_pool(y, "max", 2, 2, 1)             # 2 x 2, the last window dropped
    ref["ip"] = y.reshape(6, -1) @ w["ip/w"].T.astype(np.float64) + w["ip/b"]
    assert ref["pool2"].shape[2:] == (3, 3) and ref["pool3"].shape[2:] == (2, 2)
    off = _off(got, ref, blobs)
    # conv1 is written in place by bn1 and relu1: Caffe's blob conv1 is relu1's output
    assert not off, f"off Caffe's forward (max abs / max(1, |ref|)): {', '.join(off)}"


PROTOTXT2 = """
name: "fwd2"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "x.txt" batch_size: 4 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 2 dilation: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "r1" relu_param { negative_slope: 0.1 } }
layer { name: "slice" type: "Slice" bottom: "r1" top: "s1" top: "s2" slice_param { slice_point: 3 } }
layer { name: "sig" type: "Sigmoid" bottom: "s1" top: "g1" }
layer { name: "tanh" type: "TanH" bottom: "s2" top: "t2" }
layer { name: "norm" type: "LRN" bottom: "t2" top: "n2"
        lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 k: 3 norm_region: WITHIN_CHANNEL } }
layer { name: "sum" type: "Eltwise" bottom: "g1" bottom: "n2" top: "e1"
        eltwise_param { operation: SUM coeff: 0.5 coeff: -2 } }
layer { name: "prod" type: "Eltwise" bottom: "g1" bottom: "n2" top: "e2" eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "g1" bottom: "n2" top: "e3" eltwise_param { operation: MAX } }
layer { name: "cat" type: "Concat" bottom: "e1" bottom: "e2" bottom: "e3" top: "c" }
layer { name: "gpool" type: "Pooling" bottom: "c" top: "gp" pooling_param { pool: AVE global_pooling: true } }
layer { name: "ip" type: "InnerProduct" bottom: "gp" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_imported_caffe_net_forward_is_caffes_more_layers(tmp_path):
    """Dilated convolution, leaky ReLU, Slice, Sigmoid, TanH, LRN within a
    channel (Caffe adds 1, whatever its k), Eltwise SUM with coeff, PROD and
    MAX, Concat, global AVE pooling."""
    rng = np.random.default_rng(11)
    data = rng.standard_normal((5, 4, 7, 7)).astype(np.float32)
    _convert(tmp_path, PROTOTXT2, data, rng.integers(0, 5, 5))
    w = {k: rng.standard_normal(s).astype(np.float32) for k, s in
         {"conv1/w": (6, 4, 3, 3), "conv1/b": (6,), "ip/w": (5, 9), "ip/b": (5,)}.items()}
    model = string(1, "fwd2")
    model += layer("conv1", "Convolution", ["data"], ["conv1"], [blob(w["conv1/w"]),
                                                                  blob(w["conv1/b"])])
    model += layer("ip", "InnerProduct", ["gp"], ["ip"], [blob(w["ip/w"]), blob(w["ip/b"])])
    (tmp_path / "w.caffemodel").write_bytes(model)
    blobs = ("r1", "g1", "n2", "e1", "e2", "e3", "c", "gp", "ip")
    got, _ = _predict(tmp_path, blobs)

    x = data.astype(np.float64)
    wd = w["conv1/w"].astype(np.float64)
    dil = np.zeros((6, 4, 5, 5))
    dil[:, :, ::2, ::2] = wd                    # a dilated kernel is a sparse larger one
    ref = {}
    y = conv(x, dil, w["conv1/b"], pad=2, stride=1, group=1)
    ref["r1"] = y = np.where(y > 0, y, 0.1 * y)
    ref["g1"] = g1 = 1 / (1 + np.exp(-y[:, :3]))
    t2 = np.tanh(y[:, 3:])
    sq = np.pad(t2 * t2, ((0, 0), (0, 0), (1, 1), (1, 1)))
    window = sum(sq[:, :, i:i + 7, j:j + 7] for i in range(3) for j in range(3))
    ref["n2"] = n2 = t2 * (1 + 0.5 / 9 * window) ** -0.75
    ref["e1"], ref["e2"], ref["e3"] = 0.5 * g1 - 2 * n2, g1 * n2, np.maximum(g1, n2)
    ref["c"] = c = np.concatenate([ref["e1"], ref["e2"], ref["e3"]], axis=1)
    ref["gp"] = gp = c.mean(axis=(2, 3), keepdims=True)
    ref["ip"] = gp.reshape(5, -1) @ w["ip/w"].T.astype(np.float64) + w["ip/b"]
    off = _off(got, ref, blobs)
    assert not off, f"off Caffe's forward (max abs / max(1, |ref|)): {', '.join(off)}"
