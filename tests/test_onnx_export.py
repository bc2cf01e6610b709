"""export onnx: the exported test-phase graph run by onnxruntime equals our
forward pass, for a net with every layer type and a GoogLeNet-style net."""
import json
import os

import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.graph import Graph
from purine_mpi.interop.caffe_convert import convert
from purine_mpi.interop.onnx_export import build_model
from purine_mpi.job.checkpoint_file import load_params
from purine_mpi.job.config import load_config
from purine_mpi.job.replica import forward_graph
from purine_mpi.runtime.dispatcher import SerialDispatcher

from .conftest import REPO, make_job, run_cli_args, train_here, write_config_file
from .test_caffe_convert import fixture, random_h5
from .test_cli import assert_user_error

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def our_forward(config, weights):
    """Our test-phase forward pass on the first test batch: {blob: value}."""
    job = make_job(config)
    graph = forward_graph(job, "test", job.data.test)
    d = SerialDispatcher(graph)
    params = load_params(weights)
    for blob in graph.params():
        d.workspace.set(blob.name, params[blob.name])
    d.run(0)
    return {name: np.array(d.workspace[name]) for name in graph.blobs if name in d.workspace.arrays}


@pytest.mark.parametrize("net,shape,classes,outputs", [
    ("all_layers.prototxt", (3, 12, 12), 4, ["ip2", "prob"]),
    ("googlenet_mini.prototxt", (3, 32, 32), 10, ["loss1/fc", "loss3/classifier"]),
])
def test_onnxruntime_equals_our_forward(tmp_path, net, shape, classes, outputs):
    data = random_h5(tmp_path / "d.h5", shape, classes, n_train=8, n_test=4)
    config, _ = convert(fixture(net), data_path=data)
    config["solver"] = {"base_lr": 0.01, "max_iter": 3}
    path = write_config_file(tmp_path, config)
    # a few training steps move the weights and batch-norm statistics off their init
    weights = train_here(path, tmp_path / "run") / "latest.h5"
    res = run_cli_args("export", "onnx", path, "--weights", weights, "--out", tmp_path / "m.onnx",
                       "--batch", config["data"]["test"]["batch_size"], "--no-raw-input")
    assert res.returncode == 0, res.stderr
    if "googlenet" in net:  # the transform is the user's to apply: the line says which
        assert "input data: already transformed (--no-raw-input): centre crop 28, subtract " \
               "mean [0.5, 0.5, 0.5]" in res.stdout, res.stdout
    model = onnx.load(str(tmp_path / "m.onnx"))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [config["data"]["test"]["batch_size"], shape[0], *(
        (28, 28) if "googlenet" in net else shape[1:])]
    onnx.checker.check_model(model)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)  # shapes agree with the spec
    assert [o.name for o in model.graph.output] == outputs
    assert [i.name for i in model.graph.input] == ["data"]
    ours = our_forward(load_config(path), str(weights))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    results = session.run(outputs, {"data": ours["data"]})
    for name, value in zip(outputs, results):
        np.testing.assert_allclose(value, ours[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_layer_onnx_cannot_express_is_a_user_error():
    g = Graph("net")
    g.add_op("data", "DataReader", [], ["data", "label"],
             {"source": {"source": "synthetic", "shape": [2], "classes": 2},
              "batch_size": 2})
    g.add_blob("w", (2, 2))
    g.add_op("mix.fwd", "WeightedSum", ["data", "w"], ["out"])
    g.infer_shapes()
    with pytest.raises(UserError, match=r"op 'mix.fwd' \(type WeightedSum\) of layer 'mix' "
                                        "cannot be expressed in ONNX"):
        build_model(g, {}, "net")


def test_export_needs_test_data_and_all_weights(tmp_path, digits_h5):
    config, _ = convert(fixture("lenet_digits.prototxt"), data_path=digits_h5)
    path = write_config_file(tmp_path, config)
    empty = tmp_path / "empty.h5"
    import h5py
    with h5py.File(empty, "w") as f:
        f.create_group("params")
    res = run_cli_args("export", "onnx", path, "--weights", empty, "--out", tmp_path / "m.onnx")
    assert_user_error(res, "lacks", "conv1/weight")
    del config["data"]["test"]
    path = write_config_file(tmp_path, config, "no_test.yaml")
    res = run_cli_args("export", "onnx", path, "--weights", empty, "--out", tmp_path / "m.onnx")
    assert_user_error(res, "data.test")
    assert not (tmp_path / "m.onnx").exists()


def test_ceil_mode_pooling_with_padding(tmp_path):
    """Caffe's rounding where it matters: 5 x 5 inputs, pad 1, the last
    window of the kernel-2 pool would start in the padding and is dropped."""
    import h5py
    config = {
        "name": "pools",
        "data": {"train": {"source": "synthetic", "shape": [2, 5, 5], "classes": 3,
                           "batch_size": 3},
                 "test": {"source": "synthetic", "shape": [2, 5, 5], "classes": 3,
                          "batch_size": 3}},
        "net": [
            {"type": "conv", "name": "conv", "bottom": "data", "top": "conv", "num_output": 2,
             "kernel": 1},
            {"type": "pool", "name": "ave", "bottom": "conv", "top": "ave", "pool": "ave",
             "kernel": 3, "stride": 2, "pad": 1, "ceil_mode": True},
            {"type": "pool", "name": "max", "bottom": "conv", "top": "max", "pool": "max",
             "kernel": 2, "stride": 2, "pad": 1, "ceil_mode": True},
            {"type": "concat", "name": "cat", "bottom": ["ave", "max"], "top": "cat"},
        ],
    }
    path = write_config_file(tmp_path, config)
    weights = tmp_path / "w.h5"
    rng = np.random.default_rng(0)
    with h5py.File(weights, "w") as f:
        f["params/conv/weight"] = rng.standard_normal((2, 2, 1, 1)).astype(np.float32)
        f["params/conv/bias"] = rng.standard_normal(2).astype(np.float32)
    res = run_cli_args("export", "onnx", path, "--weights", weights, "--out", tmp_path / "m.onnx")
    assert res.returncode == 0, res.stderr
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(tmp_path / "m.onnx")),
                                                 strict_mode=True)
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims[1:]] == [4, 3, 3]
    ours = our_forward(load_config(path), str(weights))
    assert ours["cat"].shape == (3, 4, 3, 3)
    (cat,) = ort.InferenceSession(str(tmp_path / "m.onnx")).run(["cat"], {"data": ours["data"]})
    np.testing.assert_allclose(cat, ours["cat"], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def uint8_digits(digits_h5, tmp_path_factory):
    """The digits as bytes (pixels 0..16), as an image file would hold them."""
    import h5py
    path = tmp_path_factory.mktemp("onnx_raw") / "digits_u8.h5"
    with h5py.File(digits_h5, "r") as src, h5py.File(path, "w") as dst:
        for split in ("train", "test"):
            dst[f"{split}/data"] = np.rint(src[f"{split}/data"][...] * 16).astype(np.uint8)
            dst[f"{split}/label"] = src[f"{split}/label"][...]
    return str(path)


def test_raw_input_model_carries_the_transform(uint8_digits, tmp_path):
    """A LeNet trained with crop, a mean file and scale on uint8 digits: the
    exported model takes the raw uint8 test split and its accuracy through
    onnxruntime is the one ``test`` reports; its logits equal our forward."""
    import h5py
    from .lmdb_fixtures import write_mean
    with h5py.File(uint8_digits, "r") as f:
        x, y = f["test/data"][...], f["test/label"][...]
        mean = write_mean(tmp_path / "mean.binaryproto", f["train/data"][...].mean(axis=0))
    transform = {"crop_size": 6, "mean_file": mean, "scale": 0.0625}
    job = os.path.join(REPO, "jobs", "digits_lenet.yaml")
    sets = [f"data.{s}.{k}={v}" for s in ("train", "test") for k, v in
            dict(transform, path=uint8_digits).items()]
    args = [a for kv in sets for a in ("--set", kv)]
    res = run_cli_args("train", job, "--iters", "120", "--out", tmp_path / "run", *args)
    assert res.returncode == 0, res.stderr
    res = run_cli_args("test", job, "--weights", tmp_path / "run" / "latest.h5", *args)
    assert res.returncode == 0, res.stderr
    want = json.loads(res.stdout.strip().splitlines()[-1])["accuracy"]
    res = run_cli_args("export", "onnx", job, "--weights", tmp_path / "run" / "latest.h5",
                       "--out", tmp_path / "m.onnx", *args)
    assert res.returncode == 0, res.stderr
    assert "input data: raw samples as the data file holds them (uint8 1 x 8 x 8); the model " \
           "applies: centre crop 6, subtract the mean image" in res.stdout, res.stdout
    model = onnx.load(str(tmp_path / "m.onnx"))
    meta = json.loads({p.key: p.value for p in model.metadata_props}["purine.preprocessing"])
    assert meta["input"] == "raw" and meta["transform"]["crop_size"] == 6
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"))
    logits = session.run(["fc2"], {"data": x})[0]
    got = float((logits.argmax(axis=1) == y).mean())
    print(json.dumps({"onnxruntime_raw_accuracy": got, "test_accuracy": want}))
    assert abs(got - want) <= 1.5 / len(y), (got, want)
    assert want > 0.5  # trained: the comparison means something
    # the first test batch through our forward pass equals the model on its raw samples
    config = load_config(job, [s for s in sets])
    ours = our_forward(config, str(tmp_path / "run" / "latest.h5"))
    batch = config["data"]["test"]["batch_size"]
    np.testing.assert_allclose(logits[:batch], ours["fc2"], rtol=1e-4, atol=1e-4)


def _numpy_axes_net(x, p):
    """NumPy reference of the net of test_axes_past_the_batch_keep_the_leading_axes
    (Caffe's semantics: a flatten or fc at axis k keeps axes 0..k-1)."""
    w, b = p["conv1/weight"], p["conv1/bias"]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    n, _, h, wd = x.shape
    conv = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            conv += np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j])
    conv += b[None, :, None, None]
    fca = conv.reshape(n, 4, -1) @ p["fca/weight"].T + p["fca/bias"]        # (N, 4, 5)
    flat = conv.reshape(n, 4, -1)                                            # flatten axis 2
    fcb = flat @ p["fcb/weight"].T + p["fcb/bias"]                          # (N, 4, 3)
    cat = np.concatenate([fca, fcb], axis=2)                                 # (N, 4, 8)
    e = np.exp(cat - cat.max(axis=1, keepdims=True))
    prob = e / e.sum(axis=1, keepdims=True)                                  # softmax axis 1
    return prob.reshape(n, -1) @ p["fc2/weight"].T + p["fc2/bias"]


def test_axes_past_the_batch_keep_the_leading_axes(tmp_path, digits_h5):
    """fc and flatten at axis 2 of a 4-D blob keep axes 0 and 1 (Caffe's
    InnerProduct and Flatten): the ONNX model equals a NumPy forward of the
    checkpoint. Before, fc at axis 2 became Flatten(axis 1) + Gemm (a model
    onnxruntime refuses: 'Dimension mismatch ... between 64 and 256') and
    flatten at axis 2 ONNX's Flatten, which merges axes 0 and 1 as well."""
    net = [{"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
            "num_output": 4, "kernel": 3, "pad": 1},
           {"type": "fc", "name": "fca", "bottom": "conv1", "top": "fca", "num_output": 5,
            "axis": 2},
           {"type": "flatten", "name": "flat", "bottom": "conv1", "top": "flat", "axis": 2},
           {"type": "fc", "name": "fcb", "bottom": "flat", "top": "fcb", "num_output": 3,
            "axis": 2},
           {"type": "concat", "name": "cat", "bottom": ["fca", "fcb"], "top": "cat", "axis": 2},
           {"type": "softmax", "name": "prob", "bottom": "cat", "top": "prob", "axis": 1},
           {"type": "fc", "name": "fc2", "bottom": "prob", "top": "fc2", "num_output": 10},
           {"type": "softmax_loss", "name": "loss", "bottom": ["fc2", "label"], "top": "loss"}]
    path = write_config_file(tmp_path, {"name": "axes", "seed": 1, "net": net, "data": {
        "train": {"source": "hdf5", "path": digits_h5, "split": "train", "batch_size": 16},
        "test": {"source": "hdf5", "path": digits_h5, "split": "test", "batch_size": 6}},
        "solver": {"base_lr": 0.05, "max_iter": 3}})
    weights = train_here(path, tmp_path / "run") / "latest.h5"
    res = run_cli_args("export", "onnx", path, "--weights", weights, "--out", tmp_path / "m.onnx")
    assert res.returncode == 0, res.stderr
    model = onnx.load(str(tmp_path / "m.onnx"))
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    import h5py
    with h5py.File(digits_h5, "r") as f:
        x = f["test/data"][:6].astype(np.float32)
    want = _numpy_axes_net(x, {k: v.astype(np.float64)
                               for k, v in load_params(str(weights)).items()})
    got, = ort.InferenceSession(str(tmp_path / "m.onnx")).run(["fc2"], {"data": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # a mapping ONNX reads otherwise (the Flatten of before) is refused, not written
    from purine_mpi.interop import onnx_export
    old = onnx_export._EMITTERS["Flatten"]
    onnx_export._EMITTERS["Flatten"] = lambda op, graph, const, helper: [helper.make_node(
        "Flatten", [op.inputs[0]], [op.outputs[0]], name=op.name, axis=int(op.attrs["axis"]))]
    try:
        with pytest.raises(UserError, match=r"ONNX's shape inference refuses the model .*"
                                             r"nothing written"):
            onnx_export.export_onnx(make_job(load_config(path)), str(weights),
                                    str(tmp_path / "bad.onnx"))
    finally:
        onnx_export._EMITTERS["Flatten"] = old
    assert not (tmp_path / "bad.onnx").exists()
