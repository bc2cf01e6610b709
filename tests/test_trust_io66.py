"""Trust audit of the file tools (session 66): layer names with a '/' (Caffe's
``loss3/classifier``) with --init-skip, layer names a checkpoint cannot hold,
and export onnx from a weights file of another net."""
import re

import numpy as np
import pytest

from purine_mpi.job.checkpoint_file import save_checkpoint

from .conftest import run_cli_args, small_net_config, write_config_file
from .test_caffemodel import blob, layer, string
from .test_cli import assert_user_error


def slashed_config(data_path, **solver):
    """The small net with its classifier named 'head/fc' (a '/' inside the name)."""
    cfg = small_net_config(data_path)
    for entry in cfg["net"]:
        if entry["name"] == "fc1":
            entry["name"] = "head/fc"
    cfg["solver"].update(max_iter=2, **solver)
    return cfg


def weights_of(fc_shape):
    rng = np.random.default_rng(0)
    return {"conv1/weight": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
            "conv1/bias": np.zeros(4, np.float32),
            "head/fc/weight": np.zeros(fc_shape, np.float32),
            "head/fc/bias": np.zeros(fc_shape[:1], np.float32)}


def test_init_skip_of_a_layer_named_with_a_slash_keeps_it_fresh(tmp_path, digits_h5):
    """The layer of 'head/fc/weight' is 'head/fc', not 'head': before, --init-skip
    head/fc said 'kept fresh' and loaded its weights anyway (here a file of a
    1000-class head: a shape error that named --init-skip head/fc as its cure)."""
    path = write_config_file(tmp_path, slashed_config(digits_h5))
    weights = save_checkpoint(str(tmp_path / "other.h5"), weights_of((1000, 64)))
    res = run_cli_args("train", path, "--out", tmp_path / "run", "--init", weights,
                       "--init-skip", "head/fc")
    assert res.returncode == 0, res.stderr
    assert "loaded 2 blobs from" in res.stdout + res.stderr, res.stdout + res.stderr


def test_init_skip_of_a_slashed_layer_with_a_caffemodel(tmp_path, digits_h5):
    """Fine-tuning a Caffe model by replacing its 'loss3/classifier'-style head."""
    path = write_config_file(tmp_path, slashed_config(digits_h5))
    w = weights_of((1000, 64))
    model = string(1, "other") + layer("conv1", "Convolution", ["data"], ["conv1"],
                                       [blob(w["conv1/weight"]), blob(w["conv1/bias"])])
    model += layer("head/fc", "InnerProduct", ["pool1"], ["head/fc"],
                   [blob(w["head/fc/weight"]), blob(w["head/fc/bias"])])
    (tmp_path / "m.caffemodel").write_bytes(model)
    res = run_cli_args("train", path, "--out", tmp_path / "run", "--init",
                       tmp_path / "m.caffemodel", "--init-skip", "head/fc")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("name", [".", "..", "a//b", "/fc", "fc/", "a/../b"])
def test_a_layer_name_a_checkpoint_cannot_hold_is_refused_at_once(tmp_path, digits_h5, name):
    """Before: the run trained and failed at its first checkpoint with exit 1
    and a ValueError ("cannot store key './weight'")."""
    cfg = small_net_config(digits_h5)
    cfg["net"][3]["name"] = name
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--out", tmp_path / "run")
    assert_user_error(res, path, "net.3.name", repr(name))
    assert not (tmp_path / "run").exists()


def test_export_onnx_names_the_blobs_of_another_net(tmp_path, digits_h5):
    """A weights file with a layer more (another net's head) gives a model
    without it: a note says so, as test and predict do."""
    pytest.importorskip("onnx")
    cfg = small_net_config(digits_h5)
    path = write_config_file(tmp_path, cfg)
    w = weights_of((10, 64))
    w = {k.replace("head/fc", "fc1"): v for k, v in w.items()}
    w["fc2/weight"] = np.zeros((10, 10), np.float32)
    weights = save_checkpoint(str(tmp_path / "other.h5"), w)
    res = run_cli_args("export", "onnx", path, "--weights", weights, "--out",
                       tmp_path / "m.onnx")
    assert res.returncode == 0, res.stderr
    assert "1 blob(s) of the file are not in the exported test-phase graph: fc2/weight" \
        in res.stderr, res.stderr


def test_convert_of_a_binary_file_says_it_is_not_a_prototxt(tmp_path):
    """A .caffemodel given as the net definition: before, the message was
    Python's codec error ("'utf-8' codec can't decode byte 0xa2 ...")."""
    model = tmp_path / "w.caffemodel"
    model.write_bytes(string(1, "x") + layer("c", "Convolution", ["data"], ["c"],
                                             [blob(np.ones((2, 1, 3, 3)))]))
    res = run_cli_args("convert", "caffe", model, "--out", tmp_path / "j.yaml")
    assert_user_error(res, str(model), "is not a text prototxt", ".caffemodel holds weights")
    res = run_cli_args("convert", "caffe", tmp_path, "--out", tmp_path / "j.yaml")
    assert_user_error(res, str(tmp_path), "is a folder; expected a text prototxt")


def test_inspect_of_a_null_dataspace_and_a_name_with_a_newline(tmp_path):
    """A dataset of h5py.Empty (HDF5's null dataspace: a dtype, no shape):
    before, inspect ended in a TypeError traceback (exit 1). A name holding
    a newline broke the table's one row per dataset."""
    import h5py
    import json
    for name in ("a.h5", "b.h5"):
        with h5py.File(tmp_path / name, "w") as f:
            f.create_dataset("null", data=h5py.Empty("f4"))
            f["two\nlines"] = np.ones(2, np.float32)
    res = run_cli_args("inspect", tmp_path / "a.h5", "--diff", tmp_path / "b.h5")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    rows = res.stdout.splitlines()
    assert any(r.startswith("/null ") and " null " in r and "null dataspace" in r
               for r in rows), res.stdout
    assert sum(r.startswith("/two\\nlines ") for r in rows) == 2, res.stdout  # table and diff
    assert any(r.startswith("/null ") and r.endswith("equal") for r in rows), res.stdout
    res = run_cli_args("inspect", "--json", tmp_path / "a.h5")
    assert res.returncode == 0, res.stderr
    by_name = {d["name"]: d for d in json.loads(res.stdout)["datasets"]}
    assert by_name["/null"]["shape"] is None and by_name["/null"]["dtype"] == "float32"
    assert by_name["/two\nlines"]["shape"] == [2]


@pytest.mark.parametrize("field,at", [("name", "net.3.name"), ("top", "net.3.top")])
def test_a_nul_in_a_layer_or_blob_name_is_refused(tmp_path, digits_h5, field, at):
    """Before: a layer 'fc\\0x' trained (exit 0) into a checkpoint whose
    parameters HDF5 had cut to 'fc' (resume and test then said it lacks
    'fcx/weight'); a NUL in a blob name made 'graph --format dot' output
    that Graphviz refuses."""
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 2
    cfg["net"][3][field] = "fc\0x"
    if field == "top":
        cfg["net"][4]["bottom"][0] = cfg["net"][5]["bottom"][0] = "fc\0x"
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--out", tmp_path / "run")
    assert_user_error(res, path, at, "NUL character")


def test_a_caffemodel_naming_a_layer_twice_says_which_blobs_won(tmp_path, digits_h5):
    """Caffe's loader copies the layers in file order, so the later of two
    layers of one name wins; before, that happened without a word (a file
    whose second 'fc1' is zeros gave a net of chance accuracy)."""
    cfg = small_net_config(digits_h5)
    path = write_config_file(tmp_path, cfg)
    w = weights_of((10, 64))
    conv = layer("conv1", "Convolution", ["data"], ["conv1"],
                 [blob(w["conv1/weight"]), blob(w["conv1/bias"])])
    fc = layer("fc1", "InnerProduct", ["pool1"], ["fc1"],
               [blob(np.ones((10, 64))), blob(np.ones(10))])
    fc_again = layer("fc1", "InnerProduct", ["pool1"], ["fc1"],
                     [blob(np.zeros((10, 64))), blob(np.zeros(10))])
    (tmp_path / "m.caffemodel").write_bytes(string(1, "x") + conv + fc + fc_again)
    res = run_cli_args("test", path, "--weights", tmp_path / "m.caffemodel")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "note: the file has an earlier layer named 'fc1': its fc1/weight, fc1/bias " \
           "replace that layer's" in out, out
    assert "not used" not in out, out


def test_a_surrogate_escape_in_the_yaml_is_refused_at_its_line(tmp_path, digits_h5):
    """YAML's "\\ud800" makes a string UTF-8 cannot encode: before, graph
    ended in a UnicodeEncodeError traceback and train in exit 1 at its first
    write (a --set value too)."""
    cfg = small_net_config(digits_h5)
    path = write_config_file(tmp_path, cfg)
    text = open(path).read().replace("name: fc1", 'name: "fc\\ud800x"')
    assert text.count("\\ud800") == 1
    with open(path, "w") as f:
        f.write(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "ud800" in t)
    res = run_cli_args("graph", path, "--format", "dot")
    assert_user_error(res, f"{path}:{line}", "surrogate")
    res = run_cli_args("train", write_config_file(tmp_path, cfg, "ok.yaml"), "--out",
                       tmp_path / "run", "--set", 'net.3.name="fc\\udc80"')
    assert_user_error(res, "net.3.name", "surrogate")


def test_prototxt_string_escapes_are_protobufs(tmp_path, digits_h5):
    """Octal and hex escapes are bytes of UTF-8 text, an unknown escape is
    refused with its line; before, a backslash was dropped and its letter
    kept: "ip\\303\\251" became layer 'ip303251', "\\d" became 'd'."""
    from purine_mpi.interop.caffe_convert import convert
    from purine_mpi.interop.prototxt import PrototxtError
    from .test_caffe_convert import fixture
    text = open(fixture("lenet_digits.prototxt")).read()
    assert text.count('name: "ip1"') == 1
    path = tmp_path / "n.prototxt"
    path.write_text(text.replace('name: "ip1"', r'name: "ip\303\251\x41"'))
    config, _ = convert(str(path), data_path=digits_h5)
    assert "ip\u00e9A" in [entry["name"] for entry in config["net"]]
    # \n decodes to a line break, which no layer name may hold (graph and
    # the logs print names; session 67's review): refused, shown escaped
    path.write_text(text.replace('name: "ip1"', r'name: "ip\n"'))
    with pytest.raises(PrototxtError) as info:
        convert(str(path), data_path=digits_h5)
    assert "'ip\\n' holds a control character" in str(info.value), str(info.value)
    path.write_text(text.replace('name: "ip1"', r'name: "ip\d1"'))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if r"\d1" in t)
    with pytest.raises(PrototxtError) as info:
        convert(str(path), data_path=digits_h5)
    assert info.value.line == line and r"unknown escape '\d'" in str(info.value)


def test_inspect_diff_names_the_corrupt_file_and_dataset(tmp_path):
    """A flipped bit in the second file's data (its Fletcher-32 checksum
    fails): before, the message blamed the first file and named no dataset."""
    import h5py
    good, bad = str(tmp_path / "good.h5"), str(tmp_path / "bad.h5")
    for path in (good, bad):
        save_checkpoint(path, {"fc/weight": np.arange(4096, dtype=np.float32).reshape(64, 64)})
    with h5py.File(bad, "r") as f:
        d = f["params/fc/weight"]
        offset = d.id.get_offset() if d.chunks is None else d.id.get_chunk_info(0).byte_offset
    with open(bad, "r+b") as fh:
        fh.seek(offset + 100)
        byte = fh.read(1)[0]
        fh.seek(offset + 100)
        fh.write(bytes([byte ^ 0x40]))
    res = run_cli_args("inspect", good, "--diff", bad)
    text = assert_user_error(res, f"'{bad}' is corrupt (dataset '/params/fc/weight')")
    assert good not in text, text


@pytest.mark.parametrize("where,text,needle", [
    ("solver", "base_lr: 0.5\n", "field 'base_lr' of SolverParameter is given twice (also on "),
    ("net", 'layer { name: "p" type: "Pooling" bottom: "data" top: "p"\n'
            '        pooling_param { pool: MAX pool: AVE kernel_size: 2 } }\n',
     "field 'pool' of PoolingParameter is given twice"),
])
def test_a_singular_prototxt_field_given_twice_is_refused(tmp_path, digits_h5, where, text,
                                                         needle):
    """Protobuf refuses a second value of a non-repeated field; before, the
    last one won without a word (base_lr 0.05 then 0.5 converted as 0.5)."""
    from purine_mpi.interop.caffe_convert import convert
    from purine_mpi.interop.prototxt import PrototxtError
    from .test_caffe_convert import fixture
    net, solver = tmp_path / "n.prototxt", tmp_path / "s.prototxt"
    net_text = open(fixture("lenet_digits.prototxt")).read()
    solver_text = open(fixture("lenet_solver.prototxt")).read()
    assert "base_lr" in solver_text
    net.write_text(net_text + text if where == "net" else net_text)
    solver.write_text(solver_text + text if where == "solver" else solver_text)
    bad = net if where == "net" else solver
    line = len(bad.read_text().splitlines()) - text.count("\n") + 1 + (where == "net")
    with pytest.raises(PrototxtError) as info:
        convert(str(net), solver_path=str(solver), data_path=digits_h5)
    assert info.value.line == line and needle in str(info.value), (info.value.line, line)
    res = run_cli_args("convert", "caffe", net, "--solver", solver, "--data", digits_h5,
                       "--out", tmp_path / "j.yaml")
    assert_user_error(res, f"{bad}:{line}", needle)


def test_a_resume_with_another_net_of_the_same_parameters_says_so(tmp_path, digits_h5):
    """The checkpoint's own config is compared with this one's net: a layer
    gone and a key changed are named; before, the run went on without a word
    (same parameter names and shapes, so nothing was refused)."""
    cfg = small_net_config(digits_h5, checkpoint={"interval": 2, "keep": 3})
    cfg["solver"]["max_iter"] = 2
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    same = run_cli_args("train", path, "--out", tmp_path / "same", "--iters", 4, "--resume",
                        tmp_path / "run" / "latest.h5")
    assert same.returncode == 0 and "differs" not in same.stdout + same.stderr, same.stderr
    cfg["net"] = [e for e in cfg["net"] if e["name"] != "relu1"]
    cfg["net"][1]["pool"] = "ave"
    other = write_config_file(tmp_path, cfg, "other.yaml")
    res = run_cli_args("train", other, "--out", tmp_path / "other", "--iters", 4, "--resume",
                       tmp_path / "run" / "latest.h5")
    assert res.returncode == 0, res.stderr
    assert "this net differs from the one that wrote it: layer 'relu1' removed; layer " \
           "'pool1' pool 'max' -> 'ave'" in res.stdout + res.stderr, res.stdout + res.stderr


#: caffe.proto's (BVLC master) ``repeated`` fields of the messages TEXT_SCHEMA
#: reads, transcribed from the .proto (those TEXT_SCHEMA leaves out included)
CAFFE_PROTO_REPEATED = {
    "NetParameter": {"input", "input_shape", "input_dim", "layer", "layers"},
    "SolverParameter": {"test_net", "test_net_param", "test_state", "test_iter", "stepvalue",
                        "weights"},
    "NetStateRule": {"stage", "not_stage"},
    "LayerParameter": {"bottom", "top", "loss_weight", "param", "blobs", "propagate_down",
                       "include", "exclude"},
    "V1LayerParameter": {"bottom", "top", "include", "exclude", "blobs", "param",
                         "blob_share_mode", "blobs_lr", "weight_decay", "loss_weight"},
    "ConvolutionParameter": {"pad", "kernel_size", "stride", "dilation"},
    "EltwiseParameter": {"coeff"},
    "SliceParameter": {"slice_point"},
    "TransformationParameter": {"mean_value"},
    "BlobShape": {"dim"},
}


def test_the_repeated_fields_are_caffe_protos():
    """Every field of TEXT_SCHEMA that caffe.proto declares ``repeated`` is in
    REPEATED, and no other: a repeated one left out refuses valid prototxts
    (before: the solver's ``test_net``, which Caffe gives once per test net,
    was 'given twice')."""
    from purine_mpi.interop.caffe_schema import REPEATED, TEXT_SCHEMA
    for message, fields in TEXT_SCHEMA.items():
        want = CAFFE_PROTO_REPEATED.get(message, set()) & set(fields)
        assert set(REPEATED.get(message, ())) == want, (message, REPEATED.get(message), want)


def test_a_solver_with_two_test_nets_converts(tmp_path, digits_h5):
    """``test_net`` twice (two test nets, a test_iter each) is valid Caffe:
    before, convert exited 2 ('field 'test_net' of SolverParameter is given
    twice'); the field is noted as ignored, as one test_net is."""
    from .test_caffe_convert import fixture
    net = fixture("lenet_digits.prototxt")
    solver = tmp_path / "s.prototxt"
    solver.write_text(f'train_net: "{net}"\ntest_net: "{net}"\ntest_net: "{net}"\n'
                      "test_iter: 6\ntest_iter: 6\ntest_interval: 300\nbase_lr: 0.05\n"
                      'lr_policy: "fixed"\nmax_iter: 900\n')
    res = run_cli_args("convert", "caffe", net, "--solver", solver, "--data", digits_h5,
                       "--out", tmp_path / "j.yaml")
    assert res.returncode == 0, res.stderr
    assert "solver: 'test_net' (line 3) is ignored" in res.stdout + res.stderr, res.stdout


@pytest.mark.parametrize("first", [True, False])
def test_a_layer_named_as_another_layers_parameter_is_refused_at_once(tmp_path, digits_h5,
                                                                     first):
    """Layers 'fc1' and 'fc1/weight': the checkpoint's dataset
    /params/fc1/weight cannot also be the group of 'fc1/weight/weight'.
    Before, the run trained and died at its first checkpoint (exit 1,
    "AttributeError: 'Dataset' object has no attribute 'create_dataset'");
    now exit 2 before training, naming both layers, in either order."""
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 2
    extra = [{"type": "fc", "name": "fc1/weight", "bottom": "pool1", "top": "fc2",
              "num_output": 10},
             {"type": "softmax_loss", "name": "loss2", "bottom": ["fc2", "label"],
              "top": "loss2"}]
    at = 3 if first else 4
    cfg["net"][at:at] = extra
    path = write_config_file(tmp_path, cfg)
    res = run_cli_args("train", path, "--out", tmp_path / "run")
    assert_user_error(res, "parameter 'fc1/weight' and layer 'fc1/weight''s parameter "
                      "'fc1/weight/weight'" if first else "parameter 'fc1/weight/weight' and "
                      "layer 'fc1''s parameter 'fc1/weight'", "rename one of the two layers")
    assert not (tmp_path / "run" / "latest.h5").exists()


def test_prototxt_unicode_escapes_are_protobufs():
    """protobuf's tokenizer reads \\uXXXX (a surrogate pair as one code
    point) and \\UXXXXXXXX; before, each was refused as an unknown escape."""
    from purine_mpi.interop.caffe_schema import REPEATED, TEXT_SCHEMA
    from purine_mpi.interop.prototxt import PrototxtError, parse

    def name(text):
        return parse(f'name: "{text}"\n', TEXT_SCHEMA, "NetParameter", "n.prototxt",
                     REPEATED).get("name")
    assert name(r"caf\u00e9") == "caf\u00e9"
    assert name(r"\U0001F600!") == "\U0001F600!"
    assert name(r"\ud83d\ude00") == "\U0001F600"
    for bad, needle in ((r"\ud83d", "lone surrogate"), (r"\u12", "needs 4 hex digits"),
                        (r"\U00110000", "past U+10FFFF")):
        with pytest.raises(PrototxtError, match=re.escape(needle)):
            name(bad)


def test_the_resume_note_names_a_key_the_new_net_adds():
    """A key this net gives and the saved one left at its default (a ReLU
    made leaky) is a change too; before, only keys the saved layer gave were
    compared, so the note said nothing. A key given as its default (top:
    the layer's name, before named as 'top None -> 'r'') and another spelling
    of the type are no change."""
    import yaml
    from purine_mpi.job.checkpoint_check import changed_net_note
    saved = [{"type": "relu", "name": "r", "bottom": "x"},
             {"type": "pool", "name": "p", "bottom": "r", "kernel": 2}]
    text = yaml.safe_dump({"net": saved})
    now = [dict(saved[0], negative_slope=0.2), dict(saved[1])]
    note = changed_net_note(text, now, "c.h5")
    assert note is not None and "layer 'r' negative_slope 0.0 -> 0.2" in note, note
    now = [dict(saved[0], top="r"), dict(saved[1], pool="max", type="pooling")]
    assert changed_net_note(text, now, "c.h5") is None
    assert changed_net_note(text, [dict(e) for e in saved], "c.h5") is None


def test_a_saved_config_is_parsed_once_and_each_caller_gets_its_own_copy():
    """A resume reads the checkpoint's config five times; it is parsed once,
    and a caller that changes its copy changes no other's."""
    import yaml
    from purine_mpi.job.checkpoint_check import _parsed_config, saved_config
    text = yaml.safe_dump({"net": [{"type": "relu", "name": "r", "bottom": "x"}]})
    _parsed_config.cache_clear()
    first = saved_config(text)
    first["net"][0]["name"] = "changed"
    assert saved_config(text)["net"][0]["name"] == "r"
    assert _parsed_config.cache_info().misses == 1
    assert saved_config("") is None and saved_config("{not: [yaml") is None


def test_export_onnx_leaves_a_train_only_head_out_without_a_note(tmp_path, digits_h5):
    """The blobs of this net's own ``phase: train`` auxiliary head are not in
    the test-phase graph by design: before, the export said '2 blob(s) of the
    file are not in the exported test-phase graph: aux/bias, aux/weight ... (a
    file of another net?)'. A blob of no layer of the net is still named."""
    pytest.importorskip("onnx")
    cfg = small_net_config(digits_h5)
    cfg["net"][4:4] = [{"type": "fc", "name": "aux", "bottom": "pool1", "top": "aux",
                        "num_output": 10, "phase": "train"},
                       {"type": "softmax_loss", "name": "aux_loss", "bottom": ["aux", "label"],
                        "top": "aux_loss", "phase": "train"}]
    path = write_config_file(tmp_path, cfg)
    w = {k.replace("head/fc", "fc1"): v for k, v in weights_of((10, 64)).items()}
    w.update({"aux/weight": np.zeros((10, 64), np.float32), "aux/bias": np.zeros(10, np.float32)})
    res = run_cli_args("export", "onnx", path, "--weights",
                       save_checkpoint(str(tmp_path / "own.h5"), w), "--out", tmp_path / "m.onnx")
    assert res.returncode == 0, res.stderr
    assert "not in the exported" not in res.stderr, res.stderr
    w["fc2/weight"] = np.zeros((10, 10), np.float32)
    res = run_cli_args("export", "onnx", path, "--weights",
                       save_checkpoint(str(tmp_path / "other.h5"), w), "--out", tmp_path / "n.onnx")
    assert res.returncode == 0, res.stderr
    assert "1 blob(s) of the file are not in the exported test-phase graph: fc2/weight;" \
        in res.stderr, res.stderr


def test_a_latin1_prototxt_is_text_not_binary(tmp_path, digits_h5):
    """A prototxt saved in Latin-1: protobuf reads bytes, so Caffe skips a
    comment's; before, convert called the file binary ('is not a text
    prototxt (binary data at byte N); a binary .caffemodel holds weights').
    Now such a comment is skipped, and a Latin-1 byte in a value is refused
    at its line, saying to save the file as UTF-8."""
    from .test_caffe_convert import fixture
    text = open(fixture("lenet_digits.prototxt"), encoding="utf-8").read()
    net = tmp_path / "n.prototxt"
    net.write_bytes(b"# Gr\xf6\xdfe: 8x8\r\n" + text.encode())
    res = run_cli_args("convert", "caffe", net, "--data", digits_h5, "--out", tmp_path / "j.yaml")
    assert res.returncode == 0, res.stderr
    net.write_bytes(text.encode() + b'\nname: "Gr\xf6\xdfe"\n')
    res = run_cli_args("convert", "caffe", net, "--data", digits_h5, "--out", tmp_path / "k.yaml")
    assert_user_error(res, f"{net}:{text.count(chr(10)) + 2}: byte 0xf6 is not UTF-8 text",
                      "save the file as UTF-8")
