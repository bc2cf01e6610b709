"""Token data (issue 37): ``data text`` writes byte-level token files, the
``text`` source reads windows of them with the data-parallel sample rule."""
import hashlib
import os

import numpy as np
import pytest

from purine_mpi.data.sources import EpochOrder, batch_indices, make_source, source_info
from purine_mpi.data.text import TextSource
from tests.conftest import EMAIL, make_job, run_cli_here


def _stdlib_stream(folder, pattern):
    """The reference: every matching file under folder, sorted by relative path."""
    import fnmatch
    files = []
    for root, _, names in os.walk(folder):
        for n in names:
            if fnmatch.fnmatchcase(n, pattern):
                files.append(os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/"))
    files.sort()
    data = b"".join(open(os.path.join(folder, f), "rb").read() for f in files)
    return files, data


def test_data_text_writes_the_byte_stream(email_h5):
    import h5py
    files, data = _stdlib_stream(EMAIL, "*.py")
    with h5py.File(email_h5, "r") as f:
        train, val = f["train/tokens"][...], f["val/tokens"][...]
        assert train.dtype == np.uint8 and val.dtype == np.uint8
        assert np.concatenate([train, val]).tobytes() == data  # every byte, in file order
        assert len(val) == round(0.1 * len(data))  # the last tenth validates
        assert [s.decode() for s in f["files"][...]] == files
        assert f["file_bytes"][...].sum() == len(data)
        a = f.attrs
        assert a["format"] == "purine_mpi.text" and a["vocab_size"] == 256
        assert a["bytes"] == len(data) and a["glob"] == "*.py" and a["val_fraction"] == 0.1
        assert a["sha256"] == hashlib.sha256(data).hexdigest()
        assert os.path.samefile(a["source"], EMAIL) and a["version"]


def test_data_text_is_deterministic_and_takes_a_file(tmp_path, email_h5):
    import h5py
    again = tmp_path / "again.h5"
    assert run_cli_here("data", "text", "--from", EMAIL, "--glob", "*.py", "--out", again,
                        "--val-fraction", "0.25").returncode == 0
    with h5py.File(email_h5, "r") as f, h5py.File(again, "r") as g:
        whole = np.concatenate([f["train/tokens"][...], f["val/tokens"][...]])
        assert np.array_equal(np.concatenate([g["train/tokens"][...], g["val/tokens"][...]]),
                              whole)
        assert len(g["val/tokens"]) == round(0.25 * len(whole))
    one = tmp_path / "one.txt"
    one.write_text("héllo wörld\n" * 50, encoding="utf-8")
    out = tmp_path / "one.h5"
    res = run_cli_here("data", "text", "--from", one, "--out", out)
    assert res.returncode == 0, res.stderr
    with h5py.File(out, "r") as f:
        assert np.concatenate([f["train/tokens"][...], f["val/tokens"][...]]).tobytes() == \
            one.read_bytes()


@pytest.mark.parametrize("args,words", [
    (["--from", "{missing}"], ["--from", "not found"]),
    (["--from", "{binary}"], ["not UTF-8", "bad.txt"]),
    (["--from", "{folder}", "--glob", "*.nothing"], ["--glob", "*.nothing"]),
    (["--from", "{folder}", "--val-fraction", "1.5"], ["--val-fraction", "1.5"]),
    ([], ["--from"]),
    (["--from", "{folder}", "--out", "{folder}/ok.txt"], ["--out", "--from"]),
    (["--from", "{folder}", "--out", "{folder}/ok.txt", "--glob", "*.txt"], ["--out", "--from"]),
])
def test_data_text_bad_input_exits_2(tmp_path, args, words):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "ok.txt").write_text("some text\n" * 20)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    names = {"missing": tmp_path / "nope", "binary": tmp_path / "bad.txt", "folder": folder}
    args = [a.format(**names) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "o.h5")]
    if "--out" in args and "--glob" not in args:  # the output is the input file: refused
        args = ["--from", str(folder / "ok.txt"), "--out", str(folder / "ok.txt")]
    res = run_cli_here("data", "text", *args, *out)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert all(w in res.stderr for w in words), res.stderr
    assert (folder / "ok.txt").read_text() == "some text\n" * 20


def _spec(path, length, shuffle, split="train"):
    return {"source": "text", "path": path, "split": split, "sequence_length": length,
            "shuffle": shuffle}


def test_text_source_windows(email_h5):
    import h5py
    with h5py.File(email_h5, "r") as f:
        tokens = f["val/tokens"][...]
    for shuffle, stride in ((True, 1), (False, 16)):
        src = make_source(_spec(email_h5, 16, shuffle, "val"))
        assert isinstance(src, TextSource)
        assert src.n_samples == (len(tokens) - 17) // stride + 1
        assert source_info(_spec(email_h5, 16, shuffle, "val")) == (src.n_samples, (16,))
        idx = np.array([0, 5, src.n_samples - 1])
        data, label = src.gather(idx)
        assert data.dtype == np.int32 and label.dtype == np.int32 and data.shape == (3, 16)
        for row, i in enumerate(idx):
            s = i * stride
            assert np.array_equal(data[row], tokens[s:s + 16])
            assert np.array_equal(label[row], tokens[s + 1:s + 17])  # the next tokens
    # the test phase's disjoint windows predict each token once
    src = make_source(_spec(email_h5, 16, False, "val"))
    _, label = src.gather(np.arange(src.n_samples))
    assert np.array_equal(label.ravel(), tokens[1:1 + 16 * src.n_samples])


def test_text_shards_like_a_bigger_batch(email_h5):
    """2 ranks x B read together exactly the windows of 1 rank x 2B, epoch after epoch."""
    from purine_mpi.ops.data import DataReader
    spec = _spec(email_h5, 32, True)

    def reader(rank, world, batch):
        op = type("Op", (), {"name": "data", "attrs": {
            "source": spec, "batch_size": batch, "rank": rank, "world_size": world,
            "seed": 7, "train": True}})()
        return DataReader(op)
    one, r0, r1 = reader(0, 1, 8), reader(0, 2, 4), reader(1, 2, 4)
    for it in (0, 1, 5):
        d, lab = one.prepare(it)
        d0, l0 = r0.prepare(it)
        d1, l1 = r1.prepare(it)
        assert np.array_equal(d, np.concatenate([d0, d1]))
        assert np.array_equal(lab, np.concatenate([l0, l1]))
    order = EpochOrder(make_source(spec).n_samples, True, 7)
    first = batch_indices(0, 0, 1, 8, order)
    assert len(set(first.tolist())) == 8 and not np.array_equal(first, np.arange(8))
    assert DataReader.infer({"source": spec, "batch_size": 4}, []) == [
        ((4, 32), "int32"), ((4, 32), "int32")]


def test_text_padding_marks_whole_windows(email_h5):
    from purine_mpi.ops.data import DataReader
    spec = _spec(email_h5, 64, False, "val")
    op = type("Op", (), {"name": "data", "attrs": {
        "source": spec, "batch_size": 4, "rank": 0, "world_size": 1, "seed": 0,
        "train": False, "pad_label": -1}})()
    n = make_source(spec).n_samples
    last = (n - 1) // 4
    _, label = DataReader(op).prepare(last, pad_limit=n)
    real = n - last * 4
    assert (label[real:] == -1).all() and (label[:real] >= 0).all()


def test_text_spec_validation(email_h5, tmp_path):
    from purine_mpi.base.errors import ConfigError
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "x",
            "input_dim": 256, "num_output": 8}]
    base = {"source": "text", "path": email_h5, "batch_size": 2, "sequence_length": 16}
    job = make_job({"net": net, "data": {"train": dict(base), "test": dict(base)}})
    assert job.data.train.split == "train" and job.data.test.split == "val"
    assert job.data.train.shuffle and not job.data.test.shuffle
    for bad, key in ((dict(base, sequence_length=0), "sequence_length"),
                     ({k: v for k, v in base.items() if k != "sequence_length"},
                      "sequence_length"),
                     (dict(base, split="test"), "split"),
                     (dict(base, mirror=True), "mirror"),
                     (dict(base, path=str(tmp_path / "none.h5")), "path")):
        with pytest.raises(ConfigError) as e:
            make_job({"net": net, "data": {"train": bad}})
        assert f"data.train.{key}" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_job({"net": net, "data": {"train": dict(base, path=str(tmp_path / "none.h5"))}})
    assert "data text" in str(e.value)


def test_text_metadata_is_read_once_per_file_version(tmp_path, monkeypatch):
    """Every graph a job composes infers the data op's shape (the start-up,
    ``plan``, ``choose``: 8 ranks x each setting): the split's token count
    is read from the file once per process and file version, again once
    the file is rewritten, and a file that fails fails every time."""
    import h5py
    from purine_mpi.base.errors import UserError
    from purine_mpi.data import text
    path = tmp_path / "tokens.h5"

    def write(n):
        with h5py.File(path, "w") as f:
            f["train/tokens"] = np.zeros(n, np.uint8)

    opened, real = [], text._open_tokens
    monkeypatch.setattr(text, "_open_tokens", lambda p, s: opened.append(p) or real(p, s))
    spec = {"source": "text", "path": str(path), "split": "train", "sequence_length": 8}
    write(100)
    assert [source_info(spec) for _ in range(3)] == [(12, (8,))] * 3  # (100 - 9) // 8 + 1
    assert text.text_resident_bytes(spec) == 100 + 9 * 8
    assert len(opened) == 1
    write(200)
    assert source_info(spec) == (24, (8,)) and len(opened) == 2
    missing = dict(spec, path=str(tmp_path / "none.h5"))
    for _ in range(2):
        with pytest.raises(UserError, match="not found"):
            source_info(missing)


def _files(path):
    import h5py
    with h5py.File(path, "r") as f:
        return list(f["files"].asstr()[...])


def test_double_star_glob_matches_zero_or_more_folders(tmp_path):
    """pathlib's '**': the files at the top of the folder match '**/*.txt' too."""
    folder = tmp_path / "txt"
    (folder / "a" / "b").mkdir(parents=True)
    for rel in ("top.txt", "a/mid.txt", "a/b/deep.txt", "a/skip.py"):
        (folder / rel).write_text(f"the text of {rel}\n" * 10)
    cases = {"**/*.txt": ["a/b/deep.txt", "a/mid.txt", "top.txt"],
             "a/**/*.txt": ["a/b/deep.txt", "a/mid.txt"],
             "a/*.txt": ["a/mid.txt"],   # '*' within one name, as pathlib
             "a/**": ["a/b/deep.txt", "a/mid.txt", "a/skip.py"]}
    for pattern, want in cases.items():
        out = tmp_path / "o.h5"
        res = run_cli_here("data", "text", "--from", folder, "--glob", pattern, "--out", out)
        assert res.returncode == 0, res.stderr
        assert _files(out) == want, pattern


def test_a_file_name_that_is_not_utf8_exits_2(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "ok.txt").write_text("some text\n" * 20)
    with open(os.path.join(os.fsencode(folder), b"bad\xff.txt"), "w") as f:
        f.write("more text\n" * 20)
    res = run_cli_here("data", "text", "--from", folder, "--out", tmp_path / "o.h5")
    assert res.returncode == 2, res.stderr
    assert "not UTF-8" in res.stderr and "bad\\xff.txt" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    # leaving it out with --glob works
    res = run_cli_here("data", "text", "--from", folder, "--glob", "ok*", "--out",
                       tmp_path / "o.h5")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("dataset", ["text", "digits"])
def test_out_naming_a_folder_exits_2(tmp_path, dataset):
    (tmp_path / "in.txt").write_text("some text\n" * 20)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--from", tmp_path / "in.txt"] if dataset == "text" else []
    res = run_cli_here("data", dataset, *args, "--out", out)
    assert res.returncode == 2, res.stderr
    assert "--out" in res.stderr and "folder" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert os.listdir(out) == []  # no temporary file left there either
