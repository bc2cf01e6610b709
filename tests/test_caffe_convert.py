"""convert caffe: the prototxt parser, every layer type and spelling, the
solver, malformed input (exit 2 with a line number), a converted LeNet that
trains on the digits, and a GoogLeNet-style net that builds its graph."""
import os

import h5py
import numpy as np
import pytest
import yaml

from purine_mpi.interop.caffe_convert import convert
from purine_mpi.interop.caffe_schema import TEXT_SCHEMA
from purine_mpi.interop.prototxt import Enum, PrototxtError, parse
from purine_mpi.job.config import load_config, resolve_config
from purine_mpi.job.replica import build_test_graph, build_train_graph

from .conftest import REPO, final_figures, make_job, run_cli_args, run_cli_here
from .opcheck import run_op
from .test_cli import assert_user_error

FIXTURES = os.path.join(REPO, "tests", "fixtures", "caffe")


def fixture(name):
    return os.path.join(FIXTURES, name)


def random_h5(path, shape, classes, n_train=16, n_test=12):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for split, n in (("train", n_train), ("test", n_test)):
            f[f"{split}/data"] = rng.random((n,) + shape, dtype=np.float32)
            f[f"{split}/label"] = rng.integers(0, classes, n)
    return str(path)


@pytest.fixture(scope="module")
def small_h5(tmp_path_factory):
    return random_h5(tmp_path_factory.mktemp("caffe") / "small.h5", (3, 12, 12), 4)


@pytest.fixture(scope="module")
def all_layers(small_h5):
    config, notes = convert(fixture("all_layers.prototxt"), data_path=small_h5)
    return config, notes, {layer["name"]: layer for layer in config["net"]}


# ------------------------------------------------------------------- parser
def test_parser_reads_every_value_form():
    text = '''# comment
    name: "a\\"b"  # trailing comment
    layer < name: 'x' type: "ReLU" bottom: "d" top: "d" >
    layer { name: "p" type: "Pooling" pooling_param: { pool: AVE kernel_size: 2, stride: 1; }
            include { phase: 1 } }
    layer { name: "c" type: "Convolution" convolution_param { pad: [1, 2] kernel_size: 3
            weight_filler { type: "gaussian" std: 1e-2 } bias_term: false } }
    '''
    net = parse(text, TEXT_SCHEMA, "NetParameter", "t.prototxt")
    assert net.get("name") == 'a"b'
    relu, pool, conv = net.all("layer")
    assert (relu.get("name"), relu.line) == ("x", 3)
    p = pool.get("pooling_param")
    assert p.get("pool") == "AVE" and isinstance(p.get("pool"), Enum)
    assert (p.get("kernel_size"), p.get("stride")) == (2, 1)
    assert pool.get("include").get("phase") == "TEST"  # enum by number
    c = conv.get("convolution_param")
    assert c.all("pad") == [1, 2] and c.get("bias_term") is False
    assert c.get("weight_filler").get("std") == pytest.approx(0.01)


@pytest.mark.parametrize("text,line,needle", [
    ('name: "x"\nlayer {\n  nmae: "y"\n}', 3, "unknown or unsupported field 'nmae'"),
    ('layer {\n  name: "y"\n', 1, "never closed"),
    ('layer { name: "y" }\n}', 2, "expected a field name"),
    ('layer { name: y }', 1, "expected a quoted string"),
    ('layer {\n convolution_param { num_output: 2.5 } }', 2, "expected an integer"),
    ('layer {\n pooling_param { pool: MIN } }', 2, "one of MAX, AVE, STOCHASTIC"),
    ('name: "abc\n', 1, "string is not closed"),
    ('layer { name: "a" } $', 1, "unexpected character"),
    ('layer { convolution_param { pad: [1, 2 } }', 1, "expected ',' or ']'"),
])
def test_parser_errors_carry_the_line(text, line, needle):
    with pytest.raises(PrototxtError) as info:
        parse(text, TEXT_SCHEMA, "NetParameter", "bad.prototxt")
    assert info.value.line == line and needle in str(info.value)
    assert str(info.value).startswith(f"bad.prototxt:{line}: ")


# ------------------------------------------------------------ every layer
def test_every_layer_type_and_spelling(all_layers, small_h5):
    config, notes, net = all_layers
    train, test = config["data"]["train"], config["data"]["test"]
    assert train == {"source": "hdf5", "path": small_h5, "batch_size": 8, "shuffle": True,
                     "scale": 0.5, "mirror": True, "mean": [0.1, 0.2, 0.3], "split": "train"}
    assert test["batch_size"] == 6 and "mirror" not in test and test["split"] == "test"
    assert net["conv_a"]["param"] == [{"lr_mult": 1.0, "decay_mult": 1.0},
                                      {"lr_mult": 2.0, "decay_mult": 0.0}]
    assert net["conv_a"]["bias_filler"] == {"type": "constant", "value": 0.1}
    b, c, d = net["conv_b"], net["conv_c"], net["conv_d"]
    assert (b["kernel"], b["pad"], b["stride"], b["bias_term"]) == ([3, 1], [1, 0], 1, False)
    assert b["weight_filler"] == {"type": "gaussian", "mean": 0.0, "std": 0.1}
    assert (c["kernel"], c["pad"], c["stride"], c["group"]) == ([3, 1], [1, 0], 1, 2)
    assert c["weight_filler"] == {"type": "uniform", "min": -0.3, "max": 0.3}
    assert (d["dilation"], d["weight_filler"]) == (2, {"type": "msra"})
    # a conv without a bias filler gets Caffe's default, constant 0
    assert d["bias_filler"] == {"type": "constant", "value": 0.0}
    assert net["pool_max"] == dict(net["pool_max"], pool="max", kernel=3, stride=2,
                                   ceil_mode=True)
    assert (net["pool_ave"]["pool"], net["pool_ave"]["kernel"]) == ("ave", 2)
    assert net["gpool"]["global"] is True
    assert net["relu_a"]["negative_slope"] == pytest.approx(0.1)
    assert (net["sig_b"]["type"], net["tanh_c"]["type"]) == ("sigmoid", "tanh")
    assert net["sum"]["coeff"] == [0.5, -1.0] and net["prod"]["operation"] == "prod"
    assert net["max"]["operation"] == "max" and net["cat"]["axis"] == 1
    assert (net["norm"]["local_size"], net["norm"]["alpha"], net["norm"]["k"]) == (3, 0.1, 1.0)
    assert net["slice"]["slice_point"] == [4, 8] and net["slice"]["top"] == ["sl1", "sl2", "sl3"]
    assert net["split_a"]["top"] == ["s1", "s2"]
    assert net["drop"]["ratio"] == 0.25 and net["reshape"]["shape"] == [0, -1]
    assert net["flat_max"]["type"] == "flatten" and net["prob"]["phase"] == "test"
    assert net["acc"]["top_k"] == 2 and net["loss"]["loss_weight"] == 1.0
    # BatchNorm + Scale are one layer; a lone BatchNorm keeps gamma/beta fixed
    assert "scale_a" not in net
    bn = net["bn_a"]
    assert (bn["type"], bn["top"], bn["eps"]) == ("batch_norm", "conv_a", 0.001)
    assert bn["moving_average_fraction"] == pytest.approx(0.9)
    assert bn["weight_filler"] == {"type": "constant", "value": 1.0}
    assert net["bn_b"]["param"] == [{"lr_mult": 0.0, "decay_mult": 0.0}] * 2
    assert any("one batch_norm layer 'bn_a'" in n for n in notes)


def test_converted_shapes_follow_caffe(all_layers):
    config = resolve_config(all_layers[0])
    graph, _ = build_train_graph(make_job(config))

    def caffe_pool(size, k, s, p):  # Caffe's pooling_layer.cpp
        out = -(-(size + 2 * p - k) // s) + 1
        return out - 1 if p and (out - 1) * s >= size + p else out

    shape = graph.blobs["pool_max"].shape
    assert shape == (8, 4, caffe_pool(12, 3, 2, 0), caffe_pool(12, 3, 2, 0)) == (8, 4, 6, 6)
    assert graph.blobs["conv_d"].shape == (8, 4, 12, 12)
    assert graph.blobs["gpool"].shape == (8, 4, 1, 1)
    assert graph.blobs["feat"].shape == (8, 4 * 36 + 4 * 36 + 4)
    updates = {op.inputs[0]: op.attrs for op in graph.ops.values() if op.op_type == "SGDUpdate"}
    assert (updates["conv_a/bias"]["lr_mult"], updates["conv_a/bias"]["decay_mult"]) == (2.0, 0.0)
    assert "bn_b/weight" not in updates or updates["bn_b/weight"]["lr_mult"] == 0.0
    assert "prob" not in graph.blobs  # a test-phase layer
    test = build_test_graph(make_job(config))
    assert any(op.op_type == "Accuracy" and op.attrs["top_k"] == 2 for op in test.ops.values())


def test_caffe_ceil_pooling_with_padding_is_exact():
    """A converted AVE pool (pad 1, kernel 3, stride 2) against a loop-by-loop
    transcription of Caffe's PoolingLayer::Forward_cpu."""
    text = '''layer { name: "in" type: "HDF5Data" top: "data" top: "label"
                      hdf5_data_param { source: "x" batch_size: 1 } }
              layer { name: "p" type: "Pooling" bottom: "data" top: "p"
                      pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }'''
    net = parse(text, TEXT_SCHEMA, "NetParameter")
    from purine_mpi.interop.caffe_convert import Converter
    entry = Converter("t", "/x.h5").convert_net(net)[0]
    x = np.random.default_rng(1).standard_normal((1, 2, 6, 6))
    attrs = {k: entry[k] for k in ("pool", "kernel", "stride", "pad", "ceil_mode")}
    y = run_op("Pool", attrs, {"x": x})[0][0]
    height = width = 6
    k, s, pad = 3, 2, 1
    out = -(-(height + 2 * pad - k) // s) + 1
    if (out - 1) * s >= height + pad:
        out -= 1
    ref = np.zeros((1, 2, out, out))
    for c in range(2):
        for ph in range(out):
            for pw in range(out):
                hs, ws = ph * s - pad, pw * s - pad
                he, we = min(hs + k, height + pad), min(ws + k, width + pad)
                size = (he - hs) * (we - ws)
                hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, height), min(we, width)
                ref[0, c, ph, pw] = x[0, c, hs:he, ws:we].sum() / size
    assert y.shape == (1, 2, 4, 4)
    np.testing.assert_allclose(y, ref, rtol=1e-12)


def test_old_layers_syntax(small_h5):
    config, _ = convert(fixture("v1_layers.prototxt"), data_path=small_h5)
    net = {layer["name"]: layer for layer in config["net"]}
    assert [layer["type"] for layer in config["net"]] == [
        "conv", "relu", "pool", "slice", "sigmoid", "concat", "fc", "softmax_loss"]
    assert (net["halves"]["axis"], net["halves"]["slice_point"]) == (1, [2])
    assert net["joined"]["axis"] == 1 and net["sig"]["phase"] == "train"  # exclude TEST
    assert net["conv1"]["param"] == [{"lr_mult": 1.0, "decay_mult": 1.0},
                                     {"lr_mult": 2.0, "decay_mult": 0.0}]
    assert net["pool1"]["pool"] == "ave" and config["data"]["train"]["batch_size"] == 4
    build_train_graph(make_job(config))


def test_solver_fields():
    config, notes = convert(fixture("lenet_digits.prototxt"), fixture("lenet_solver.prototxt"),
                            data_path="/nonexistent/digits.h5")
    assert config["solver"] == {"type": "sgd", "base_lr": 0.05, "lr_policy": "step",
                                "momentum": 0.9, "weight_decay": 0.0005, "max_iter": 900,
                                "display": 100, "test_interval": 300, "gamma": 0.1,
                                "stepsize": 600, "test_iter": 6, "test_initialization": True}
    assert config["checkpoint"] == {"interval": 300, "folder": os.path.abspath("lenet")}
    assert config["seed"] == 1 and any("snapshot_prefix 'lenet'" in n for n in notes)
    assert any("'solver_mode' (line 16) is ignored" in n for n in notes)
    # Caffe tests at iteration 0 unless test_initialization: false (the converter
    # said "'test_initialization' is ignored: no equivalent", and the converted
    # job tested first at iteration 300)
    assert not any("test_initialization" in n for n in notes)


def test_test_initialization_converts_to_the_key(tmp_path):
    with open(fixture("lenet_solver.prototxt")) as f:
        text = f.read()
    for line, want in (("test_initialization: false", False), ("test_initialization: true", True),
                       ("test_interval: 0", None)):
        path = tmp_path / "solver.prototxt"
        path.write_text(text.replace("test_interval: 300", "test_interval: 0")
                        if line == "test_interval: 0" else text + "\n" + line + "\n")
        config, notes = convert(fixture("lenet_digits.prototxt"), str(path),
                                data_path="/nonexistent/digits.h5")
        assert config["solver"].get("test_initialization") is want, (line, config["solver"])
        assert not any("test_initialization" in n for n in notes), notes


@pytest.mark.parametrize("ignore", [False, True])
def test_iter_size_with_an_ignore_label_keeps_caffe_s_mean_of_means(tmp_path, ignore):
    """Caffe's iter_size K divides each of its K batches by its own counted
    positions and averages their gradients: a loss with an ignore_label
    converts to parallel.ignore_label_mean: shard (said in a note); without
    one the default stays (the same figures either way)."""
    with open(fixture("lenet_digits.prototxt")) as f:
        net = f.read()
    if ignore:
        net = net.replace('top: "loss"\n', 'top: "loss"\n  loss_param { ignore_label: 3 }\n')
        assert "ignore_label" in net
    (tmp_path / "net.prototxt").write_text(net)
    with open(fixture("lenet_solver.prototxt")) as f:
        (tmp_path / "solver.prototxt").write_text(f.read() + "\niter_size: 2\n")
    config, notes = convert(str(tmp_path / "net.prototxt"), str(tmp_path / "solver.prototxt"),
                            data_path="/nonexistent/digits.h5")
    assert config["parallel"]["micro_batches"] == 2
    assert config["parallel"].get("ignore_label_mean") == ("shard" if ignore else None)
    assert any("parallel.ignore_label_mean shard" in n for n in notes) == ignore


@pytest.mark.parametrize("text,key,value", [
    ('base_lr: 0.1 lr_policy: "multistep" stepvalue: 10 stepvalue: 30 gamma: 0.5',
     "stepvalues", [10, 30]),
    ('base_lr: 0.1 lr_policy: "poly" power: 2', "power", 2.0),
    ('base_lr: 0.1 lr_policy: "inv" gamma: 0.1 power: 0.75', "lr_policy", "inv"),
    ('base_lr: 0.1 lr_policy: "exp" gamma: 0.99', "gamma", 0.99),
    ('base_lr: 0.001 type: "Adam" momentum: 0.9 momentum2: 0.99 delta: 1e-6', "type", "adam"),
    ('base_lr: 0.001 solver_type: ADAM momentum2: 0.99', "momentum2", 0.99),
    ('base_lr: 0.01 type: "RMSProp" rms_decay: 0.9', "rms_decay", 0.9),
    ('base_lr: 1.0 solver_type: ADADELTA momentum: 0.95 delta: 1e-6', "delta", 1e-6),
    ('base_lr: 0.01 type: "Nesterov" momentum: 0.9', "type", "nesterov"),
    ('base_lr: 0.01 type: "AdaGrad"', "type", "adagrad"),
])
def test_solver_policies(tmp_path, text, key, value):
    path = tmp_path / "s.prototxt"
    path.write_text(text)
    config, _ = convert(fixture("v1_layers.prototxt"), str(path), data_path="/x.h5")
    assert config["solver"][key] == value
    resolve_config(config, check_files=False)  # our validator accepts it


# ---------------------------------------------------------------- the CLI
@pytest.mark.parametrize("name,line,needles", [
    ("bad_unknown_field.prototxt", 6, ["layer 'conv1' (type Convolution)",
                                       "unknown or unsupported field 'kernel_sise'",
                                       "did you mean 'kernel_size'"]),
    ("bad_unclosed.prototxt", 2, ["not closed before 'layer' on line 4"]),
    ("bad_bottom.prototxt", 5, ["layer 'ip' (type InnerProduct)", "bottom 'relu9'"]),
    ("bad_cycle.prototxt", 4, ["cycle", "'a' (line 4) -> 'b' (line 5) -> 'a'"]),
    ("bad_layer_type.prototxt", 5, ["layer 'deconv' (type Deconvolution)", "not supported"]),
])
def test_bad_prototxt_exits_2_with_the_line(tmp_path, small_h5, name, line, needles):
    res = run_cli_here("convert", "caffe", fixture(name), "--data", small_h5,
                       "--out", tmp_path / "x.yaml")
    assert_user_error(res, f"{name}:{line}: ", *needles)
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("snippet,needle", [
    ('layer { name: "s" type: "Scale" bottom: "data" top: "s" }', "only right after a BatchNorm"),
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { pool: '
     'STOCHASTIC kernel_size: 2 } }', "STOCHASTIC pooling is not supported"),
    ('layer { name: "r" type: "ReLU" bottom: "data" top: "x" }\n'
     'layer { name: "r" type: "TanH" bottom: "x" top: "y" }', "also used on line 3"),
    ('layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { '
     'num_output: 2 kernel_size: 3 weight_filler { type: "bilinear" } } }',
     "filler type 'bilinear' is not supported"),
])
def test_unsupported_semantics_name_layer_and_line(tmp_path, snippet, needle):
    path = tmp_path / "n.prototxt"
    path.write_text('layer { name: "in" type: "HDF5Data" top: "data" top: "label"\n'
                    '        hdf5_data_param { source: "x" batch_size: 2 } }\n' + snippet + "\n")
    with pytest.raises(PrototxtError) as info:
        convert(str(path), data_path="/x.h5")
    assert info.value.line == 3 + snippet.count("\n") and needle in str(info.value)


IMAGE_DATA = """layer { name: "img" type: "ImageData" top: "data" top: "label"
        image_data_param { source: "list.txt" batch_size: 5 shuffle: true }
        transform_param { crop_size: 6 mirror: true mean_value: 104 mean_value: 117
                          mean_value: 123 scale: 0.017 } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
        inner_product_param { num_output: 3 } }
"""


def test_image_data_layer(tmp_path):
    path = tmp_path / "i.prototxt"
    path.write_text(IMAGE_DATA)
    config, _ = convert(str(path), data_path="/x.h5")
    for phase in ("train", "test"):  # a data layer without include serves both
        spec = config["data"][phase]
        assert (spec["batch_size"], spec["shuffle"], spec["crop_size"], spec["split"]) == (
            5, True, 6, phase)
        assert spec["mean"] == [104.0, 117.0, 123.0] and spec["scale"] == pytest.approx(0.017)


@pytest.mark.parametrize("snippet,line,needle", [
    ('layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"\n'
     '        convolution_param { num_output: 4 kernel_size: 3 group: 2 } }', 3,
     "layer 'conv' (type Convolution): key 'net[0].group'"),
    ('layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"\n'
     '        convolution_param { num_output: 4 kernel_size: 3 } }\n'
     'layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "data" top: "sum" }', 5,
     "layer 'sum' (type Eltwise): op 'sum.fwd' (Eltwise)"),
])
def test_what_our_layers_reject_names_the_prototxt_line(small_h5, tmp_path, snippet, line,
                                                        needle):
    path = tmp_path / "n.prototxt"
    path.write_text('layer { name: "in" type: "HDF5Data" top: "data" top: "label"\n'
                    '        hdf5_data_param { source: "x" batch_size: 2 } }\n' + snippet + "\n")
    with pytest.raises(PrototxtError) as info:
        convert(str(path), data_path=small_h5)
    assert info.value.line == line and needle in str(info.value)


def test_data_layers_need_data_file(tmp_path):
    res = run_cli_here("convert", "caffe", fixture("v1_layers.prototxt"),
                       "--out", tmp_path / "x.yaml")
    assert_user_error(res, "v1_layers.prototxt:3:", "--data")


def test_converted_lenet_trains_on_digits_like_our_job(digits_h5, digits_lenet_final, tmp_path):
    """The converted LeNet + solver reaches the accuracy of jobs/digits_lenet.yaml
    (trained once a session on the same digits file)."""
    job = tmp_path / "lenet.yaml"
    res = run_cli_args("convert", "caffe", fixture("lenet_digits.prototxt"), "--solver",
                       fixture("lenet_solver.prototxt"), "--data", digits_h5, "--out", job)
    assert res.returncode == 0, res.stderr
    assert "note: solver: 'solver_mode'" in res.stdout
    res = run_cli_args("train", job, "--out", tmp_path / "caffe",
                       "--set", f"data.train.path={digits_h5}",
                       "--set", f"data.test.path={digits_h5}", timeout=300)
    assert res.returncode == 0, res.stderr
    results = {"caffe": final_figures(res)["accuracy"], "ours": digits_lenet_final["accuracy"]}
    assert results["caffe"] >= 0.97
    assert results["caffe"] >= results["ours"] - 0.01, results


def test_googlenet_style_net_builds_its_training_graph(tmp_path):
    data = random_h5(tmp_path / "g.h5", (3, 32, 32), 10, n_train=8, n_test=4)
    job = tmp_path / "g.yaml"
    res = run_cli_here("convert", "caffe", fixture("googlenet_mini.prototxt"), "--data", data,
                       "--out", job)
    assert res.returncode == 0, res.stderr
    config = load_config(str(job))
    assert config["data"]["train"]["crop_size"] == 28 and config["data"]["train"]["mirror"]
    graph, grads = build_train_graph(make_job(config))
    concat = [op for op in graph.ops.values() if op.op_type == "Concat"]
    assert len(concat) == 4 and all(len(op.inputs) == 4 for op in concat)
    # 28 -> conv 7/2 -> 14 -> pool 3/2 (ceil) -> 7 -> pool 3/2 (ceil) -> 3
    assert graph.blobs["inception_3a/output"].shape == (4, 8 + 16 + 8 + 8, 7, 7)
    assert graph.blobs["inception_4b/output"].shape == (4, 48, 3, 3)
    assert graph.blobs["loss1/ave_pool"].shape == (4, 48, 1, 1)
    weights = {b.name: b.attrs["loss_weight"] for b in graph.blobs.values()
               if "loss_weight" in b.attrs}
    assert weights == {"loss1/loss1": 0.3, "loss3/loss3": 1.0}
    assert "inception_4b/5x5/weight" in grads and len(grads) == 2 * 29
    res = run_cli_args("train", job, "--iters", "2", "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["name"] == \
        "GoogLeNetMini"


def test_batchnorm_running_average_is_caffes():
    """The converted BatchNorm's running statistics against a transcription of
    Caffe's BatchNormLayer::Forward_cpu (sums and a scale factor), across a
    save/restore of the kernel's step count."""
    from purine_mpi.graph.core import Op
    from purine_mpi.ops.batchnorm import BatchNorm
    maf, channels = 0.9, 3
    attrs = {"eps": 1e-5, "momentum": 0.1, "phase": "train", "moving_average_fraction": maf}

    def kernel():
        return BatchNorm(Op("bn.fwd", "BatchNorm", list("xgbmv"), list("yabmv"), attrs))

    rng = np.random.default_rng(3)
    batches = [rng.standard_normal((4, channels, 2, 2)) * (i + 1) + i for i in range(5)]
    sums, factor = np.zeros((2, channels)), 0.0
    running = [np.zeros(channels), np.ones(channels)]
    k = kernel()
    for step, x in enumerate(batches):
        if step == 2:  # a resumed run continues the count
            state, k = k.state_dict(), kernel()
            k.load_state_dict(state)
            assert state == {"factor": pytest.approx(1 + maf)}
        outs = [np.empty_like(x), np.empty(channels), np.empty(channels)] + running
        k.run([x, np.ones(channels), np.zeros(channels)] + running, outs)
        m = x.size // channels
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3)) * m / (m - 1)
        factor = factor * maf + 1
        sums = maf * sums + np.stack([mean, var])
        np.testing.assert_allclose(running[0], sums[0] / factor, rtol=1e-12)
        np.testing.assert_allclose(running[1], sums[1] / factor, rtol=1e-12)


NEGATIVE_AXES = """layer { name: "in" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "x" batch_size: 8 } }
layer { name: "cut" type: "Slice" bottom: "data" top: "a" top: "b"
        slice_param { axis: %(s)d slice_point: 1 } }
layer { name: "join" type: "Concat" bottom: "b" bottom: "a" top: "ba"
        concat_param { axis: %(c)d } }
layer { name: "sm" type: "Softmax" bottom: "ba" top: "p" softmax_param { axis: %(c)d } }
layer { name: "ip" type: "InnerProduct" bottom: "p" top: "ip"
        inner_product_param { num_output: 4 axis: %(c)d } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
        softmax_param { axis: %(k)d } }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc"
        accuracy_param { axis: %(k)d } include { phase: TEST } }
"""


def test_a_negative_caffe_axis_is_its_positive_axis(tmp_path, small_h5):
    """Caffe counts a negative axis from the end: Slice/Concat/Softmax/
    InnerProduct axis -3 of (N, 3, 12, 12) is 1, SoftmaxWithLoss/Accuracy
    axis -1 of (N, 4) scores is 1. They were refused (our concat, slice and
    softmax took axis >= 0; the converter took InnerProduct, loss and
    accuracy axis 1 only); the graphs must be the positive axes' ones."""
    def graphs(**axes):
        path = tmp_path / "n.prototxt"
        path.write_text(NEGATIVE_AXES % axes)
        job = make_job(resolve_config(convert(str(path), data_path=small_h5)[0]))
        return build_train_graph(job)[0], build_test_graph(job)

    def ops(g):
        return {name: (op.op_type, op.attrs, [g.blobs[b].shape for b in op.outputs])
                for name, op in g.ops.items()}

    for ours, positive in zip(graphs(s=-3, c=-3, k=-1), graphs(s=1, c=1, k=1)):
        assert ops(ours) == ops(positive)
    assert ours.blobs["p"].shape == (8, 3, 12, 12) and ours.blobs["ip"].shape == (8, 4)
    path = tmp_path / "n.prototxt"
    for axes, line, needle in (({"s": 1, "c": -5, "k": 1}, 5, "layer 'join' (type Concat)"),
                               ({"s": -5, "c": 1, "k": 1}, 3, "layer 'cut' (type Slice)"),
                               ({"s": 1, "c": 1, "k": -3}, 10, "layer 'loss'")):
        path.write_text(NEGATIVE_AXES % axes)
        with pytest.raises(PrototxtError) as info:
            convert(str(path), data_path=small_h5)
        assert info.value.line == line and needle in str(info.value), str(info.value)
        assert "got -" in str(info.value)
