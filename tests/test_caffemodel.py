"""--init / test --weights with a Caffe .caffemodel: a file written here by
an independent protobuf wire-format encoder loads exactly, by layer name."""
import struct

import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.interop.caffe_convert import convert
from purine_mpi.interop.caffemodel import caffe_params
from purine_mpi.train.trainer import Trainer

from .conftest import FakeWorld, make_job, run_cli_args, write_config_file
from .test_caffe_convert import fixture, random_h5
from .test_cli import assert_user_error


# ------------------------------------------------- an independent encoder
def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def key(number, wire):
    return varint(number << 3 | wire)


def length_delimited(number, payload):
    return key(number, 2) + varint(len(payload)) + payload


def string(number, text):
    return length_delimited(number, text.encode())


def blob(array, packed=True, legacy=False):
    """BlobProto: shape {dim} (7) + data (5), or the legacy num/channels/height/width;
    ``packed`` writes the repeated fields packed (as Caffe does) or one by one."""
    array = np.asarray(array, dtype=np.float32)
    if legacy:
        dims = (1,) * (4 - array.ndim) + array.shape
        out = b"".join(key(n, 0) + varint(d) for n, d in zip((1, 2, 3, 4), dims))
    else:
        if packed:  # BlobShape.dim is [packed = true] in caffe.proto
            shape = length_delimited(1, b"".join(varint(d) for d in array.shape))
        else:
            shape = b"".join(key(1, 0) + varint(d) for d in array.shape)
        out = length_delimited(7, shape)
    values = array.reshape(-1)
    if packed:
        out += length_delimited(5, struct.pack(f"<{values.size}f", *values))
    else:
        out += b"".join(key(5, 5) + struct.pack("<f", v) for v in values)
    return out


def layer(name, kind, bottoms, tops, blobs):
    """LayerParameter (NetParameter field 100)."""
    body = string(1, name) + string(2, kind)
    body += b"".join(string(3, b) for b in bottoms) + b"".join(string(4, t) for t in tops)
    body += b"".join(length_delimited(7, b) for b in blobs)
    return length_delimited(100, body)


def v1_layer(name, type_number, blobs):
    """V1LayerParameter (NetParameter field 2): name 4, type 5 (enum), blobs 6."""
    body = string(4, name) + key(5, 0) + varint(type_number)
    body += b"".join(length_delimited(6, b) for b in blobs)
    return length_delimited(2, body)


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def net(tmp_path_factory):
    d = tmp_path_factory.mktemp("caffemodel")
    data = random_h5(d / "small.h5", (3, 12, 12), 4)
    config, _ = convert(fixture("all_layers.prototxt"), data_path=data)
    config["solver"] = {"base_lr": 0.01, "max_iter": 1}
    return d, config, write_config_file(d, config)


def known_weights():
    rng = np.random.default_rng(42)
    w = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in {
        "conv_a/weight": (8, 3, 3, 3), "conv_a/bias": (8,), "bn_a/mean": (8,),
        "bn_a/var": (8,), "bn_a/gamma": (8,), "bn_a/beta": (8,), "conv_b/weight": (4, 8, 3, 1),
        "ip1/weight": (16, 292), "ip1/bias": (16,), "bn_b/mean": (4,), "bn_b/var": (4,)}.items()}
    w["bn_a/var"], w["bn_b/var"] = np.abs(w["bn_a/var"]), np.abs(w["bn_b/var"])
    return w


def write_caffemodel(path, w, factor=4.0, conv_b_shape=None):
    """Caffe stores BatchNorm sums with a scale factor: blobs (mean*f, var*f, [f])."""
    f = np.float32(factor)
    conv_b = w["conv_b/weight"] if conv_b_shape is None else np.zeros(conv_b_shape, np.float32)
    model = string(1, "all_layers")
    model += layer("input", "HDF5Data", [], ["data", "label"], [])
    model += layer("conv_a", "Convolution", ["data"], ["conv_a"],
                   [blob(w["conv_a/weight"]), blob(w["conv_a/bias"], packed=False)])
    model += layer("bn_a", "BatchNorm", ["conv_a"], ["conv_a"],
                   [blob(w["bn_a/mean"] * f), blob(w["bn_a/var"] * f), blob([f])])
    model += layer("scale_a", "Scale", ["conv_a"], ["conv_a"],
                   [blob(w["bn_a/gamma"]), blob(w["bn_a/beta"])])
    model += layer("conv_b", "Convolution", ["s1"], ["conv_b"], [blob(conv_b)])
    model += layer("bn_b", "BatchNorm", ["sl3"], ["bn_b"],
                   [blob(w["bn_b/mean"] * f), blob(w["bn_b/var"] * f), blob([f])])
    model += layer("old_net_layer", "InnerProduct", ["x"], ["y"], [blob(np.ones((2, 3)))])
    # an old-style entry with legacy 4-D blobs (1 x 1 x out x in), V1 type 14 = INNER_PRODUCT
    model += v1_layer("ip1", 14, [blob(w["ip1/weight"], legacy=True),
                                  blob(w["ip1/bias"], legacy=True, packed=False)])
    with open(path, "wb") as fh:
        fh.write(model)
    return str(path)


def test_caffemodel_loads_exactly(net, capsys):
    d, config, _ = net
    w = known_weights()
    path = write_caffemodel(d / "known.caffemodel", w)
    logs = []
    with pytest.raises(UserError, match=r"lacks 6 parameter\(s\) of this net: conv_c/weight"):
        Trainer(make_job(config), str(d / "run"), world=FakeWorld(), init=path,
                log=logs.append)
    # the layers the file lacks keep their fresh initialisation when named
    t = Trainer(make_job(config), str(d / "run"), world=FakeWorld(), init=path,
                log=logs.append, init_skip=["conv_c", "conv_d", "ip2"])
    try:
        expect = {"conv_a/weight": w["conv_a/weight"], "conv_a/bias": w["conv_a/bias"],
                  "bn_a/running_mean": w["bn_a/mean"], "bn_a/running_var": w["bn_a/var"],
                  "bn_a/weight": w["bn_a/gamma"], "bn_a/bias": w["bn_a/beta"],
                  "conv_b/weight": w["conv_b/weight"], "ip1/weight": w["ip1/weight"],
                  "ip1/bias": w["ip1/bias"], "bn_b/running_mean": w["bn_b/mean"],
                  "bn_b/running_var": w["bn_b/var"]}
        for name, value in expect.items():
            np.testing.assert_array_equal(np.asarray(t.ws[name]), value, err_msg=name)
        # Caffe's moving-average factor carries over: the next running mean is
        # (maf * factor * mean + batch mean) / (maf * factor + 1), not the batch mean
        bn = [k for k in t.train.kernels.values() if k.op.op_type == "BatchNorm"
              and k.op.inputs[3] == "bn_a/running_mean"]
        assert len(bn) == 1 and bn[0].factor == 4.0
    finally:
        t.close()
    text = "\n".join(logs)
    assert "matched scale_a (Scale) -> bn_a: weight [8], bias [8]" in text
    assert "matched ip1 (InnerProduct): weight [16, 292], bias [16]" in text
    assert "not used: old_net_layer" in text


def test_cli_reports_matches_and_rejects_shape_mismatch(net):
    d, _, cfg_path = net
    w = known_weights()
    good = write_caffemodel(d / "good.caffemodel", w)
    res = run_cli_args("test", cfg_path, "--weights", good, "--out", d / "t")
    # test keeps stdout for its JSON result: the match report is logged on stderr,
    # before the error
    report, _, error = res.stderr.rpartition("error: ")
    assert "matched conv_a (Convolution)" in report and res.stdout == ""
    res.stderr = "error: " + error
    assert_user_error(res, "good.caffemodel", "lacks", "conv_c/weight")
    res = run_cli_args("train", cfg_path, "--init", good, "--init-skip", "conv_c,conv_d",
                       "--init-skip", "ip2", "--out", d / "t", "--iters", "1")
    assert res.returncode == 0, res.stderr
    assert "matched conv_a (Convolution): weight [8, 3, 3, 3], bias [8]" in res.stdout
    bad = write_caffemodel(d / "bad.caffemodel", w, conv_b_shape=(4, 8, 1, 3))
    res = run_cli_args("train", cfg_path, "--init", bad, "--out", d / "r", "--iters", "1")
    assert_user_error(res, "bad.caffemodel", "layer 'conv_b'", "[4, 8, 1, 3]", "[4, 8, 3, 1]")


def test_not_a_caffemodel(tmp_path):
    path = tmp_path / "x.caffemodel"
    path.write_bytes(b"\xff\xff\xff")
    with pytest.raises(UserError, match="not a Caffe NetParameter"):
        caffe_params(str(path), {})
    with pytest.raises(UserError, match="not found"):
        caffe_params(str(tmp_path / "missing.caffemodel"), {})


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_parameter_servers_load_a_caffemodel(mode, tmp_path):
    """``--init MODEL.caffemodel`` under the parameter-server modes (3
    ranks, one server): the server reads Caffe's weights by layer name as
    the workers do, and with a learning rate of 0 the run's weights (the
    server's, which the workers pull) are the file's. Before, a server read
    every --init file but a .safetensors as HDF5: 'error: rank 2: weights
    file '...w.caffemodel' is not an HDF5 file'."""
    from purine_mpi.job.config import dump_config
    from .conftest import checkpoint_arrays
    from .mpi_scripts.common import mlp_config
    from .mpi_scripts.launch import run_python
    cfg = mlp_config(solver={"base_lr": 0.0, "max_iter": 1},
                     parallel={"mode": mode, "ps_ranks": 1, "max_staleness": int(mode == "async")})
    path = tmp_path / "mlp.yaml"
    path.write_text(dump_config(cfg))
    rng = np.random.default_rng(7)
    shapes = {"fc1": (6, 8), "fc2": (5, 6), "out": (3, 5)}
    w = {f"{n}/{k}": rng.standard_normal(s if k == "weight" else s[:1]).astype(np.float32)
         for n, s in shapes.items() for k in ("weight", "bias")}
    model = string(1, "mlp") + b"".join(
        layer(n, "InnerProduct", [], [], [blob(w[f"{n}/weight"]), blob(w[f"{n}/bias"])])
        for n in shapes)
    init = tmp_path / "w.caffemodel"
    init.write_bytes(model)
    proc, _ = run_python(3, ["-m", "purine_mpi", "train", str(path), "--out", str(tmp_path / "run"),
                             "--init", str(init)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = checkpoint_arrays(tmp_path / "run" / "latest.h5")
    for name, value in w.items():
        np.testing.assert_array_equal(got[f"params/{name}"], value, err_msg=name)
