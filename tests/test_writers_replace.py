"""The data and prediction writers (``_write_splits``, ``write_lmdb``,
``write_text``, predict's ``_write``) go through ``runfiles.write_replacing``:
a write that fails after part of its output is written (a full disk here,
injected: HDF5 fails on its second dataset) leaves what was at the
destination as it was, or nothing where nothing was, no temporary file, and
one line naming the file and what to do."""
import errno
import os
import types

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError

OLD = b"the previous file"


@pytest.fixture
def disk_full_mid_write(monkeypatch):
    """HDF5's second ``create_dataset`` of a write fails with ENOSPC (the
    first one is written: the temporary file holds part of the output)."""
    real, calls = h5py.Group.create_dataset, []

    def create_dataset(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("name"))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(h5py.Group, "create_dataset", create_dataset)
    return calls


def _fails_and_leaves_the_destination(out, write, before):
    if before:
        out.write_bytes(OLD)
    with pytest.raises(UserError) as err:
        write(str(out))
    assert str(err.value) == f"{out}: no space left on device; free space there or give " \
                             "another --out", str(err.value)
    assert os.listdir(out.parent) == ([out.name] if before else []), os.listdir(out.parent)
    if before:
        assert out.read_bytes() == OLD


@pytest.mark.parametrize("before", [True, False], ids=["file-there", "no-file"])
def test_write_splits(tmp_path, disk_full_mid_write, before):
    from purine_mpi.data.datasets import _write_splits
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    splits = {"train": (x, np.arange(2)), "test": (x, np.arange(2))}
    (tmp_path / "out").mkdir()
    _fails_and_leaves_the_destination(
        tmp_path / "out" / "d.h5", lambda p: _write_splits(p, splits, {"source": "t"}), before)
    assert disk_full_mid_write[:2] == ["data", "label"]


@pytest.mark.parametrize("before", [True, False], ids=["file-there", "no-file"])
def test_write_lmdb(tmp_path, disk_full_mid_write, before):
    from purine_mpi.data.datasets import write_lmdb as convert
    from tests.lmdb_fixtures import write_lmdb
    rng = np.random.default_rng(0)
    db = write_lmdb(tmp_path / "db", rng.integers(0, 256, (3, 1, 4, 4), np.uint8),
                    [0, 1, 2])
    (tmp_path / "out").mkdir()
    _fails_and_leaves_the_destination(
        tmp_path / "out" / "d.h5", lambda p: convert({"train": db}, p), before)
    assert disk_full_mid_write[:2] == ["data", "label"]


@pytest.mark.parametrize("before", [True, False], ids=["file-there", "no-file"])
def test_write_text(tmp_path, disk_full_mid_write, before):
    from purine_mpi.data.text import write_text
    src = tmp_path / "src.txt"
    src.write_text("some text to split into a train and a validation stream\n" * 4)
    (tmp_path / "out").mkdir()
    _fails_and_leaves_the_destination(tmp_path / "out" / "t.h5",
                                      lambda p: write_text(str(src), p), before)
    assert disk_full_mid_write[:2] == ["tokens", "tokens"]


@pytest.mark.parametrize("before", [True, False], ids=["file-there", "no-file"])
def test_predict_write(tmp_path, disk_full_mid_write, monkeypatch, before):
    from purine_mpi.tools import predict
    monkeypatch.setattr(predict, "dump_config", lambda job: "config")
    rows = {"fc2": np.ones((3, 2), np.float32), "label": np.arange(3)}
    (tmp_path / "out").mkdir()
    _fails_and_leaves_the_destination(
        tmp_path / "out" / "p.h5",
        lambda p: predict._write(p, rows, ["fc2"], types.SimpleNamespace(job=None), "w.h5",
                                 "test", 3), before)
    assert disk_full_mid_write[:2] == ["fc2", "label"]


def _old_h5(path):
    """An earlier data file there (``data`` and ``label``: the kind the data
    commands write, which they may replace; another kind they refuse)."""
    with h5py.File(path, "w") as f:
        f.attrs["old"] = 1
        f["data"] = np.zeros((2, 1, 2, 2), np.float32)
        f["label"] = np.zeros(2, np.int64)
    return path.read_bytes()


@pytest.mark.parametrize("command,before", [("digits", True), ("text", False),
                                            ("lmdb-to-h5", True)])
def test_a_data_command_past_the_file_size_limit_is_one_line(tmp_path, command, before):
    """The operating system refuses HDF5's own writes (the file-size limit,
    ``ulimit -f`` of 40 KiB, as a full disk does with ENOSPC; found on a
    64 KiB tmpfs, where ``data digits`` failed the same way): exit 2, the
    one line naming the file, nothing new left, a file already there
    untouched (each writer once; with and without a file there). Before, the writers opened the temporary file by name with
    HDF5's own driver: HDF5's 'Can't close dataset (file write failed ...
    errno = 27, error message = 'File too large' ...)', a RuntimeError's
    traceback and a crash (exit -11: the first assertion failed)."""
    import resource
    import subprocess
    from tests.conftest import PYTHON, REPO, cli_env
    from tests.lmdb_fixtures import write_lmdb
    rng = np.random.default_rng(0)
    args = []
    if command == "text":   # incompressible: 200 kB of random letters
        src = tmp_path / "src.txt"
        src.write_bytes(bytes(rng.integers(97, 123, 200_000, dtype=np.uint8)))
        args = ["--from", src]
    elif command == "lmdb-to-h5":   # 150 kB of random pixels
        args = ["--from", write_lmdb(tmp_path / "db", rng.integers(
            0, 256, (200, 3, 16, 16), np.uint8), list(range(200)))]
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "d.h5"
    old = _old_h5(out) if before else None
    limit = 40 << 10

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "data", command, "--out", str(out)]
                         + [str(a) for a in args], cwd=REPO, env=dict(
                             cli_env(), PYTHONDONTWRITEBYTECODE="1"), preexec_fn=limited,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: {out}: file too large for this process's file-size limit ('ulimit -f') or "
        "the file system; raise the limit or give another --out"), res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert os.listdir(out.parent) == (["d.h5"] if before else []), os.listdir(out.parent)
    if before:
        assert out.read_bytes() == old


def test_the_written_files_keep_their_modes(tmp_path, monkeypatch):
    """Under umask 002 a data file is -rw-rw-r-- (0o666 less the umask, as
    HDF5 made it by name before the writers went through a GuardedFile,
    whose 0o644 gave -rw-r--r--: the data files' assertion failed), a
    prediction file -rw-r--r-- (as predict's GuardedFile always made it)."""
    import stat
    from purine_mpi.data.datasets import _write_splits
    from purine_mpi.data.text import write_text
    from purine_mpi.tools import predict
    monkeypatch.setattr(predict, "dump_config", lambda job: "config")
    x = np.zeros((2, 1, 4, 4), np.float32)
    src = tmp_path / "src.txt"
    src.write_text("some text to split into a train and a validation stream\n" * 4)
    old = os.umask(0o002)
    try:
        _write_splits(str(tmp_path / "d.h5"), {"train": (x, np.arange(2))}, {})
        write_text(str(src), str(tmp_path / "t.h5"))
        predict._write(str(tmp_path / "p.h5"), {"fc2": x[:, 0, 0], "label": np.arange(2)},
                       ["fc2"], types.SimpleNamespace(job=None), "w.h5", "test", 2)
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in ("d.h5", "t.h5", "p.h5")}
    assert modes == {"d.h5": 0o664, "t.h5": 0o664, "p.h5": 0o644}, modes
