"""Trust audit of the commands' bad inputs (session 64): each case was a
traceback or a silent choice before, and is now one ``error:`` line (exit
2) naming the file and what was expected, or a note. All small; the
subprocess cases are the ones that start MPI (``train``)."""
import os
import shutil

import numpy as np
import pytest

from .conftest import (FakeWorld, make_job, run_cli_args, run_cli_here, small_net_config,
                       train_here, write_config_file)
from .test_cli import assert_user_error


@pytest.fixture(scope="module")
def tiny(digits_h5, tmp_path_factory):
    """A 1-iteration run of the small digits net: {dir, cfg, path, weights}."""
    d = tmp_path_factory.mktemp("audit64")
    cfg = small_net_config(digits_h5)
    cfg["solver"]["max_iter"] = 1
    path = write_config_file(d, cfg)
    train_here(cfg, d / "run")
    return {"dir": d, "cfg": cfg, "path": path, "weights": d / "run" / "latest.h5"}


def test_an_output_under_a_file_is_one_line(tmp_path):
    """``data digits --out FILE/x.h5`` (a path whose folder is a file) was
    os.makedirs' FileExistsError traceback (exit 1); predict, export, plot
    and convert take the same check (job/outputs.check_out)."""
    (tmp_path / "afile").write_text("x")
    res = run_cli_here("data", "digits", "--out", tmp_path / "afile" / "x.h5")
    assert_user_error(res, "afile is a file, not a folder", "--out")


def test_a_run_folder_that_is_a_file_is_named_as_such(tmp_path, tiny):
    """``train --out FILE`` said "cannot set it up: File exists"; now it says
    the path is a file and what to give."""
    (tmp_path / "afile").write_text("x")
    res = run_cli_args("train", tiny["path"], "--out", tmp_path / "afile")
    assert_user_error(res, "afile is a file, not a folder", "--out")
    assert (tmp_path / "afile").read_text() == "x"


def test_inspect_diff_of_a_record_array_and_floats(tmp_path):
    """``inspect A --diff B`` where a dataset is a record array in one file
    and floats in the other: NumPy's TypeError traceback (exit 1); now the
    row says they differ."""
    import json

    import h5py
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.zeros(2, dtype=[("a", "f4"), ("b", "i4")])
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["x"] = np.zeros(2)
    res = run_cli_here("inspect", tmp_path / "a.h5", "--diff", tmp_path / "b.h5", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["diff"]["datasets"] == [{"name": "/x", "equal": False,
                                                         "status": "differs"}]


def test_graph_np_below_one_is_refused(tiny):
    """``graph --np 0`` composed one rank's graph as if --np 1 were given
    (exit 0); --np -2 said "--rank 0 is outside 0..-3"."""
    for n in (0, -2):
        res = run_cli_here("graph", tiny["path"], "--np", n)
        assert_user_error(res, f"--np {n}", ">= 1")


def test_weights_of_text_values_are_one_line(tiny, tmp_path):
    """A weights file whose parameter dataset holds strings: ``export
    onnx`` (and test, --init, generate: replica.init_params) raised
    NumPy's "could not convert string to float" traceback."""
    pytest.importorskip("onnx")
    import h5py
    bad = tmp_path / "bad.h5"
    shutil.copy(tiny["weights"], bad)
    with h5py.File(bad, "a") as f:
        del f["params/fc1/bias"]
        f["params"].create_dataset("fc1/bias", data=np.array([b"a"] * 10, dtype="S1"))
    res = run_cli_here("export", "onnx", tiny["path"], "--weights", bad,
                       "--out", tmp_path / "m.onnx")
    assert_user_error(res, str(bad), "/params/fc1/bias", "expected numbers")
    assert not (tmp_path / "m.onnx").exists()


def test_init_beside_a_resume_says_it_is_not_used(tiny, tmp_path):
    """``train --init W --resume CKPT``: the checkpoint's weights replace
    --init's without a word; now a note says --init is not used."""
    lines = []
    _trainer(tiny["cfg"], tmp_path / "r", log=lines.append, resume=str(tiny["weights"]),
             init=str(tiny["weights"])).close()
    notes = [line for line in lines if "--init" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: --init {tiny['weights']} is not "
                                                   "used"), lines


def test_an_archive_that_is_not_a_tar_gz_is_one_line(tmp_path):
    """``data cifar10 --from X.tar.gz`` of bytes that are no archive: the
    error was five lines (tarfile lists each compression it tried on a
    line of its own)."""
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(np.random.default_rng(0).bytes(1000))
    res = run_cli_here("data", "cifar10", "--from", archive, "--out", tmp_path / "c.h5")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    # the progress line "unpacking ...", then the error: one line naming the file
    errors = res.stderr[res.stderr.index("error: "):].strip().splitlines()
    assert len(errors) == 1, res.stderr
    assert str(archive) in errors[0] and "not a readable .tar.gz" in errors[0], errors
    assert not (tmp_path / "c.h5").exists()


def _trainer(cfg, out, **kw):
    """A Trainer on one rank inside this process (its stop handlers restored)."""
    import signal

    from purine_mpi.runtime.stop import StopSignal
    from purine_mpi.train.trainer import Trainer
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in StopSignal.CAUGHT}
    try:
        return Trainer(make_job(cfg), str(out), world=FakeWorld(), **kw)
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)


def test_a_test_pass_that_counts_nothing_says_so(tiny, tmp_path):
    """Every test label the ignore_label: ``test`` printed loss 0.0 and
    accuracy 0.0 over "360 samples" without a word, figures that measure
    nothing (Caffe's 0 for no counted position); now a note says so."""
    import copy

    import h5py
    path = tmp_path / "ign.h5"
    with h5py.File(tiny["cfg"]["data"]["test"]["path"], "r") as f, h5py.File(path, "w") as g:
        for split in ("train", "test"):
            g[f"{split}/data"] = f[f"{split}/data"][...]
            g[f"{split}/label"] = np.full(len(f[f"{split}/label"]), 3) if split == "test" \
                else f[f"{split}/label"][...]
    cfg = copy.deepcopy(tiny["cfg"])
    for spec in cfg["data"].values():
        spec["path"] = str(path)
    for layer in cfg["net"]:
        if layer["type"] in ("softmax_loss", "accuracy"):
            layer["ignore_label"] = 3
    lines = []
    t = _trainer(cfg, tmp_path / "r", init=str(tiny["weights"]), log=lines.append)
    try:
        res = t.evaluate()
    finally:
        t.close()
    assert res["accuracy"] == 0.0 and res["loss"] == 0.0, res
    notes = [line for line in lines if "counted no position" in line]
    assert len(notes) == 1 and "accuracy, loss" in notes[0], lines


def test_an_empty_split_is_named_as_such(tmp_path):
    """A split of 0 samples said "'/t/data' has 0 samples but '/t/label'
    has 0; they must agree and be > 0"."""
    import h5py

    from purine_mpi.base.errors import UserError
    from purine_mpi.data.sources import hdf5_info
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f["t/data"] = np.zeros((0, 1, 2, 2), np.float32)
        f["t/label"] = np.zeros(0, np.int64)
    with pytest.raises(UserError, match=r"'/t/data' holds no samples \(shape \[0, 1, 2, 2\]\)"):
        hdf5_info(str(tmp_path / "e.h5"), "t")


def test_predict_of_a_batch_figure_is_one_line(tiny, tmp_path):
    """``predict --blob loss`` (a scalar: one figure per batch) was NumPy's
    "zero-dimensional arrays cannot be concatenated" traceback; a blob
    whose first axis is not the batch's would have been cut into wrong rows."""
    from purine_mpi.base.errors import UserError
    from purine_mpi.tools.predict import predict
    t = _trainer(tiny["cfg"], tmp_path / "r", init=str(tiny["weights"]), log=lambda m: None)
    try:
        with pytest.raises(UserError, match=r"blob\(s\) loss \[\] hold no row per sample .* "
                                            r"choose among .*fc1"):
            predict(t, str(tmp_path / "p.h5"), str(tiny["weights"]), ["loss"])
        assert predict(t, str(tmp_path / "q.h5"), str(tiny["weights"]), ["fc1"])["samples"] > 0
    finally:
        t.close()
    assert not (tmp_path / "p.h5").exists()


def test_export_onnx_batch_below_one_is_refused(tiny, tmp_path):
    """``export onnx --batch -1`` wrote a model whose input's first
    dimension is -1 (and --batch 0 a free batch), exit 0."""
    pytest.importorskip("onnx")
    for n in (0, -1):
        res = run_cli_here("export", "onnx", tiny["path"], "--weights", tiny["weights"],
                           "--out", tmp_path / "m.onnx", "--batch", n)
        assert_user_error(res, f"--batch {n}", ">= 1")
    assert not (tmp_path / "m.onnx").exists()


def test_inspect_json_of_bytes_and_complex_attributes(tmp_path):
    """``inspect --json`` of a file whose attributes are raw bytes (np.void)
    or complex: json's "Object of type bytes is not JSON serializable"
    traceback; the text form printed them. Now strict JSON with their text."""
    import json

    import h5py
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f.attrs["v"] = np.void(b"\x00\xff")
        f.attrs["c"] = 1 + 2j
        f["x"] = np.arange(3.0)
    res = run_cli_here("inspect", tmp_path / "a.h5", "--json")
    assert res.returncode == 0, res.stderr
    attrs = json.loads(res.stdout)["attrs"]
    assert attrs == {"v": "\x00\\xff", "c": "(1+2j)"}, attrs


def test_export_hf_writes_into_an_existing_folder(tmp_path):
    """``export hf --out DIR`` writes a folder, "made if missing"
    (docs/formats.md); an existing DIR (an empty one, or the same export
    again) was refused with "is a folder, but the output is one file". A
    byte-level model into a DIR holding another export's tokenizer.json,
    which Hugging Face would load with it, is refused."""
    pytest.importorskip("safetensors.numpy")
    from .gpt_nets import gpt_config, text_h5
    cfg = gpt_config(text_h5(tmp_path), layers=1, iters=1)
    path = write_config_file(tmp_path, cfg)
    weights = train_here(path, tmp_path / "run") / "latest.h5"
    out = tmp_path / "hf"
    out.mkdir()
    for _ in range(2):  # an empty folder, then the export it holds
        res = run_cli_here("export", "hf", path, "--weights", weights, "--out", out)
        assert res.returncode == 0, res.stderr
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    (out / "tokenizer.json").write_text("{}")
    res = run_cli_here("export", "hf", path, "--weights", weights, "--out", out)
    assert_user_error(res, "tokenizer.json", "byte-level")
    # a GPT-2 BPE's files (a downloaded model's folder): GPT2TokenizerFast
    # builds its vocabulary from vocab.json and merges.txt as well
    (out / "tokenizer.json").unlink()
    (out / "vocab.json").write_text('{"a": 0}')
    (out / "merges.txt").write_text("#version: 0.2\n")
    res = run_cli_here("export", "hf", path, "--weights", weights, "--out", out)
    assert_user_error(res, "vocab.json and merges.txt", "byte-level")
