"""convert caffe on a Caffe tree as users have it (issue 26): Data layers
reading LMDBs relative to the working directory, mean files, the solver
fields (iter_size, clip_gradients, snapshot_prefix, random_seed, Adam),
the test-length note, LEVELDB refused; an AlexNet-style and a
GoogLeNet-style net build from LMDB sources; a LeNet on a digits LMDB
trains to the accuracy of our digits job."""
import json
import os
import re

import h5py
import numpy as np
import pytest

from purine_mpi.interop.caffe_convert import convert
from purine_mpi.job.config import load_config
from purine_mpi.job.replica import build_train_graph

from .conftest import final_figures, make_job, run_cli_args, run_cli_here
from .lmdb_fixtures import write_lmdb, write_mean
from .test_caffe_convert import fixture
from .test_cli import assert_user_error

LENET_DATA = """name: "LeNetDigits"
layer {
  name: "mnist" type: "Data" top: "data" top: "label"
  include { phase: TRAIN }
  transform_param { scale: 0.0625 }
  data_param { source: "examples/mnist/digits_train_lmdb" batch_size: 32 backend: LMDB }
}
layer {
  name: "mnist" type: "Data" top: "data" top: "label"
  include { phase: TEST }
  transform_param { scale: 0.0625 }
  data_param { source: "examples/mnist/digits_test_lmdb" batch_size: 60 backend: LMDB }
}
"""


def lenet_body():
    """The layers of tests/fixtures/caffe/lenet_digits.prototxt after its data layers."""
    text = open(fixture("lenet_digits.prototxt")).read()
    return text[text.index('layer {\n  name: "conv1"'):]


@pytest.fixture(scope="module")
def digits_tree(digits_h5, tmp_path_factory):
    """examples/mnist/digits_{train,test}_lmdb: the digits (pixels 0..16 as
    uint8, the values of our HDF5 file times 16) in Caffe's layout, with
    the LeNet prototxt and solver beside them."""
    root = tmp_path_factory.mktemp("caffe_tree")
    mnist = root / "examples" / "mnist"
    with h5py.File(digits_h5, "r") as f:
        for split in ("train", "test"):
            x = np.rint(f[f"{split}/data"][...] * 16).astype(np.uint8)
            write_lmdb(mnist / f"digits_{split}_lmdb", x, f[f"{split}/label"][...])
    (mnist / "lenet_train_test.prototxt").write_text(LENET_DATA + lenet_body())
    solver = open(fixture("lenet_solver.prototxt")).read()
    solver = solver.replace('net: "lenet_digits.prototxt"',
                            'net: "examples/mnist/lenet_train_test.prototxt"')
    solver = solver.replace('snapshot_prefix: "lenet"', 'snapshot_prefix: "examples/mnist/lenet"')
    (mnist / "lenet_solver.prototxt").write_text(solver)
    return root


def test_convert_without_data_reads_the_trees_lmdbs(digits_tree):
    res = run_cli_here("convert", "caffe", "examples/mnist/lenet_train_test.prototxt",
                       "--solver", "examples/mnist/lenet_solver.prototxt",
                       "--out", "lenet.yaml", cwd=digits_tree)
    assert res.returncode == 0, res.stderr
    train_db = digits_tree / "examples" / "mnist" / "digits_train_lmdb"
    assert f"reads the LMDB {train_db} (source 'examples/mnist/digits_train_lmdb', " \
           f"resolved against the working directory {digits_tree}" in res.stdout
    # test_iter 6 x 60 = 360: exactly the split, so no note on its length
    assert "test_iter 6" not in res.stdout
    config = load_config(str(digits_tree / "lenet.yaml"))
    assert config["data"]["train"] == {"source": "lmdb", "path": str(train_db),
                                       "batch_size": 32, "shuffle": False, "scale": 0.0625}
    assert config["checkpoint"]["folder"] == str(digits_tree / "examples" / "mnist" / "lenet")
    assert config["seed"] == 1


@pytest.mark.slow
def test_lenet_on_a_digits_lmdb_trains_like_our_digits_job(digits_tree, digits_lenet_final):
    """The converted job trains from the tree without --data or --out (its
    runs go to snapshot_prefix's folder) and reaches our job's accuracy
    (jobs/digits_lenet.yaml on the digits file, trained once a session)."""
    res = run_cli_args("convert", "caffe", "examples/mnist/lenet_train_test.prototxt",
                       "--solver", "examples/mnist/lenet_solver.prototxt",
                       "--out", "lenet_lmdb.yaml", cwd=digits_tree)
    assert res.returncode == 0, res.stderr
    res = run_cli_args("train", "lenet_lmdb.yaml", cwd=digits_tree, timeout=300)
    assert res.returncode == 0, res.stderr
    lmdb_acc = final_figures(res)["accuracy"]
    assert (digits_tree / "examples" / "mnist" / "lenet" / "1" / "latest.h5").is_file()
    ours = digits_lenet_final["accuracy"]
    print(json.dumps({"lenet_lmdb_accuracy": lmdb_acc, "digits_lenet_accuracy": ours}))
    assert abs(lmdb_acc - ours) <= 0.02, (lmdb_acc, ours)


ALEXNET = """name: "AlexNetStyle"
layer {
  name: "data" type: "Data" top: "data" top: "label"
  include { phase: TRAIN }
  transform_param { mirror: true crop_size: 227
                    mean_file: "data/ilsvrc12/imagenet_mean.binaryproto" }
  data_param { source: "examples/imagenet/ilsvrc12_train_lmdb" batch_size: 2 backend: LMDB }
}
layer {
  name: "data" type: "Data" top: "data" top: "label"
  include { phase: TEST }
  transform_param { mirror: false crop_size: 227
                    mean_file: "data/ilsvrc12/imagenet_mean.binaryproto" }
  data_param { source: "examples/imagenet/ilsvrc12_val_lmdb" batch_size: 2 backend: LMDB }
}
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 11 stride: 4
                      weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1"
  lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 8 pad: 2 kernel_size: 5 group: 2
                      weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool2" top: "fc6"
  inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.005 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6"
  dropout_param { dropout_ratio: 0.5 } }
layer { name: "fc8" type: "InnerProduct" bottom: "fc6" top: "fc8"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "fc8" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }
"""

SOLVER = """net: "models/alexnet/train_val.prototxt"
test_iter: 3
test_interval: 1000
base_lr: 0.001
type: "Adam"
momentum: 0.9
momentum2: 0.999
lr_policy: "fixed"
max_iter: 2
iter_size: 2
clip_gradients: 10
snapshot_prefix: "models/alexnet/caffe_alexnet"
random_seed: 7
"""


@pytest.fixture(scope="module")
def imagenet_tree(tmp_path_factory):
    """A Caffe tree with 256 x 256 colour LMDBs (raw and JPEG-like PNG
    records) and the mean image of the training set."""
    root = tmp_path_factory.mktemp("imagenet_tree")
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (6, 3, 256, 256), dtype=np.uint8)
    y = rng.integers(0, 4, 6)
    write_lmdb(root / "examples/imagenet/ilsvrc12_train_lmdb", x, y, "png", names=True)
    write_lmdb(root / "examples/imagenet/ilsvrc12_val_lmdb", x[:5], y[:5])
    os.makedirs(root / "data/ilsvrc12")
    write_mean(root / "data/ilsvrc12/imagenet_mean.binaryproto", x.mean(axis=0))
    os.makedirs(root / "models/alexnet")
    (root / "models/alexnet/train_val.prototxt").write_text(ALEXNET)
    (root / "models/alexnet/solver.prototxt").write_text(SOLVER)
    return root


def test_alexnet_style_net_converts_and_trains_from_lmdb(imagenet_tree):
    res = run_cli_args("convert", "caffe", "models/alexnet/train_val.prototxt", "--solver",
                       "models/alexnet/solver.prototxt", "--out", "alexnet.yaml",
                       cwd=imagenet_tree)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    mean = imagenet_tree / "data/ilsvrc12/imagenet_mean.binaryproto"
    assert f"mean_file 'data/ilsvrc12/imagenet_mean.binaryproto' -> {mean}" in out
    assert "iter_size 2 -> data.train.batch_size 2 x 2 = 4 in parallel.micro_batches 2" in out
    assert "solver.clip_gradients is 5 on their mean" in out
    # 3 x 2 = 6 reads of a 5-sample split: a full pass, the first sample twice
    assert "reads 6 samples of a 5-sample test split: a full pass, and the first sample " \
           "counts twice" in out
    config = load_config(str(imagenet_tree / "alexnet.yaml"))
    train = config["data"]["train"]
    assert (train["source"], train["crop_size"], train["mirror"], train["mean_file"]) == (
        "lmdb", 227, True, str(mean))
    assert train["batch_size"] == 4 and config["parallel"]["micro_batches"] == 2
    assert config["solver"]["type"] == "adam" and config["solver"]["clip_gradients"] == 5.0
    assert config["seed"] == 7
    graph, _ = build_train_graph(make_job(config))  # one micro-batch: Caffe's batch of 2
    assert graph.blobs["data"].shape == (2, 3, 227, 227)
    assert graph.blobs["conv1"].shape == (2, 8, 55, 55)
    assert graph.blobs["pool2"].shape == (2, 8, 13, 13)
    res = run_cli_args("train", "alexnet.yaml", "--out", "run", cwd=imagenet_tree, timeout=300)
    assert res.returncode == 0, res.stderr
    assert re.search(r"test @ iter 2: loss [0-9.]+", res.stdout), res.stdout
    # the ONNX model takes the LMDB's raw 256 x 256 bytes and applies crop and mean itself
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from .test_onnx_export import our_forward
    res = run_cli_args("export", "onnx", "alexnet.yaml", "--weights", "run/latest.h5", "--out",
                       "alexnet.onnx", "--batch", 2, cwd=imagenet_tree)
    assert res.returncode == 0, res.stderr
    assert "raw samples as the data file holds them (uint8 3 x 256 x 256)" in res.stdout
    model = onnx.load(str(imagenet_tree / "alexnet.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    from purine_mpi.data.sources import make_source
    raw, _ = make_source(config["data"]["test"]).gather([0, 1])
    logits = ort.InferenceSession(str(imagenet_tree / "alexnet.onnx")).run(["fc8"],
                                                                            {"data": raw})[0]
    ours = our_forward(config, str(imagenet_tree / "run" / "latest.h5"))
    np.testing.assert_allclose(logits, ours["fc8"], rtol=1e-4, atol=1e-5)


def test_googlenet_style_net_builds_from_lmdb(imagenet_tree, tmp_path):
    text = open(fixture("googlenet_mini.prototxt")).read()
    text = text.replace("crop_size: 28", "crop_size: 224")
    text = text.replace("mean_value: 0.5 mean_value: 0.5 mean_value: 0.5",
                        "mean_value: 104 mean_value: 117 mean_value: 123")
    text = text.replace('source: "train_lmdb"',
                        'source: "examples/imagenet/ilsvrc12_train_lmdb"')
    text = text.replace('source: "test_lmdb"', 'source: "examples/imagenet/ilsvrc12_val_lmdb"')
    net = imagenet_tree / "googlenet.prototxt"
    net.write_text(text)
    res = run_cli_here("convert", "caffe", net, "--out", tmp_path / "g.yaml", cwd=imagenet_tree)
    assert res.returncode == 0, res.stderr
    config = load_config(str(tmp_path / "g.yaml"))
    train = config["data"]["train"]
    assert (train["source"], train["crop_size"], train["mean"]) == ("lmdb", 224,
                                                                     [104.0, 117.0, 123.0])
    graph, grads = build_train_graph(make_job(config))
    assert graph.blobs["data"].shape == (4, 3, 224, 224)
    # 224 -> conv 7/2 -> 112 -> pool 3/2 (ceil) -> 56
    assert graph.blobs["inception_3a/output"].shape == (4, 40, 56, 56)
    assert len(grads) == 2 * 29


def test_test_iter_beyond_the_split_counts_each_repeat(digits_tree, tmp_path):
    solver = tmp_path / "s.prototxt"
    solver.write_text("base_lr: 0.01\ntest_iter: 100\n")
    cwd = os.getcwd()
    os.chdir(digits_tree)
    try:
        net = digits_tree / "examples/mnist/lenet_train_test.prototxt"
        _, notes = convert(str(net), str(solver))
    finally:
        os.chdir(cwd)
    # 100 x 60 = 6000 reads of 360 samples: 16 passes and 240 more
    assert any("reads 6000 samples of a 360-sample test split: 16 full passes and a part: "
               "the first 240 samples count 17 times, the other 120 count 16 times" in n
               for n in notes), notes


@pytest.mark.parametrize("backend,needle", [
    ("backend: LEVELDB", "backend LEVELDB is not supported: convert the database to LMDB"),
    ("", "backend LEVELDB (Caffe's default: the layer gives no backend) is not supported"),
])
def test_leveldb_is_refused_naming_the_layer(tmp_path, backend, needle):
    net = tmp_path / "n.prototxt"
    net.write_text('layer { name: "d" type: "Data" top: "data" top: "label"\n'
                   f'  data_param {{ source: "x_leveldb" batch_size: 2 {backend} }} }}\n'
                   'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
                   '  inner_product_param { num_output: 2 } }\n')
    res = run_cli_here("convert", "caffe", net, "--out", tmp_path / "x.yaml")
    assert_user_error(res, "layer 'd' (type Data)", needle, "--data")


@pytest.mark.parametrize("batches,batch,ranks,n,needle", [
    (100, 100, 1, 360, "10000 samples of a 360-sample test split: 27 full passes and a part: "
                       "the first 280 samples count 28 times, the other 80 count 27 times"),
    (3, 2, 1, 5, "6 samples of a 5-sample test split: a full pass, and the first sample "
                 "counts twice"),
    (6, 60, 2, 360, "720 samples of a 360-sample test split: 2 full passes, each sample counts "
                    "2 times"),
    (6, 60, 1, 360, None), (5, 60, 1, 360, None),
])
def test_repeat_note_counts_what_the_wrapping_reader_reads(batches, batch, ranks, n, needle):
    """The note's counts against the reader's rule: position p reads sample
    p mod n (test data is not shuffled)."""
    from purine_mpi.data.sources import repeat_note
    note = repeat_note(batches, batch, ranks, n)
    counts = np.bincount(np.arange(batches * batch * ranks) % n, minlength=n)
    if needle is None:
        assert note is None and counts.max() <= 1
        return
    assert needle in note, note
    q = counts.min()
    r = int((counts > q).sum())
    assert f" {q} " in note
    assert r == 0 or (f"first {r} samples" if r > 1 else "first sample") in note
