"""A second read of session 68's aliases, diff status and folders through
links (cca1868), by hostile files and paths: a soft link through ``..``
(a link's name to HDF5, never the parent group) or to a name that is not
UTF-8 (h5py shows its value as b'...'), int64 against uint64 in
``--diff`` (said "equal" where the values differ), a hard link to the root
deep inside /params (named as the alias of '/', before the root's other
groups are read through it), a download whose cache folder runs through a
dangling link (its target made), and outputs through ``link/..`` (the
folder made lexically beside the link), and groups each linking twice to
the next (plan --init's count walked all 2**n names). Each test failed
on cca1868 (the assertion named in its text)."""
import hashlib
import json
import os

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from tests.conftest import run_cli_here


def _json(*args):
    res = run_cli_here(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def test_a_soft_link_through_dotdot_resolves_as_hdf5_resolves_it(tmp_path):
    """HDF5 takes ``..`` in a soft link's path as a link's name: ``../a/w``
    from /p/c dangles (refused in one line as dangling, the file not called
    corrupt; /p/a/w exists, which a lexical ``..`` would reach), and
    ``../w`` where /p holds a group named ``..`` is a soft link to /p/../w
    (listed as its alias, not refused). Before: "dangling"
    missing from the first refusal ("is corrupt: KeyError"), and the second
    file refused (exit 2)."""
    bad, good = tmp_path / "bad.h5", tmp_path / "good.h5"
    with h5py.File(bad, "w") as f:
        f["p/a/w"] = np.ones(2)
        f["p/c/s"] = h5py.SoftLink("../a/w")
    with h5py.File(good, "w") as f:
        f["p/a/w"] = np.ones(2)
        f.create_group("p/..")["w"] = np.zeros(1)
        f["p/s"] = h5py.SoftLink("../w")
        f["p/t"] = h5py.SoftLink("./a//w")
    res = run_cli_here("inspect", bad)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "'/p/c/s' is a dangling soft link to '../a/w'" in res.stderr, res.stderr
    report = _json("inspect", good, "--json")
    assert [d["name"] for d in report["datasets"]] == ["/p/../w", "/p/a/w"]
    assert {a["name"]: a["alias_of"] for a in report["aliases"]} == {"/p/s": "/p/../w",
                                                                     "/p/t": "/p/a/w"}


def test_a_soft_link_to_a_name_that_is_not_utf8_is_followed(tmp_path):
    """Soft links whose targets are not UTF-8 (/g\\xff/caf\\xe9, /g\\xff),
    read as HDF5 keeps them (bytes), are listed as aliases of those
    objects; one through an external link is still refused naming it.
    Before: refused as "a dangling soft link to 'b'/g\\xff/caf\\xe9''"
    (h5py's SoftLink shows a value that is not UTF-8 as the text b'...')."""
    path, out = tmp_path / "names.h5", tmp_path / "out.h5"
    with h5py.File(path, "w") as f:
        f.create_group(b"params/g\xff")[b"caf\xe9"] = np.ones(2)
        f.id.links.create_soft(b"params/s", b"/params/g\xff/caf\xe9")
        f.id.links.create_soft(b"params/sg", b"/params/g\xff")
    report = _json("inspect", path, "--json")
    assert [d["name"] for d in report["datasets"]] == ["/params/g\\xff/caf\\xe9"]
    assert [(a["name"], a["alias_of"]) for a in report["aliases"]] == [
        ("/params/s", "/params/g\\xff/caf\\xe9"), ("/params/sg", "/params/g\\xff")]
    with h5py.File(out, "w") as f:
        f["params/w"] = np.ones(2)
        f.id.links.create_external(b"params/e\xff", b"other\xff.h5", b"/x")
        f.id.links.create_soft(b"params/s", b"/params/e\xff/y")
    res = run_cli_here("inspect", out)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "external link" in res.stderr and "dangling" not in res.stderr, res.stderr


def test_diff_of_int64_against_uint64_is_exact(tmp_path):
    """2**62 + 1 (int64) against 2**62 (uint64), which float64 cannot tell
    apart, differs by 1; a negative int64 against a uint64 differs; the
    same values in the two types are equal. Before: ``status`` was
    "equal" for the first (max_abs_diff 0.0)."""
    a, b, c = (tmp_path / n for n in ("a.h5", "b.h5", "c.h5"))
    with h5py.File(a, "w") as f:
        f["x"] = np.array([2**62 + 1, 7], dtype=np.int64)
        f["neg"] = np.array([-1, 2**63 - 1], dtype=np.int64)
        f["same"] = np.array([0, 2**63 - 1], dtype=np.int64)
    with h5py.File(b, "w") as f:
        f["x"] = np.array([2**62, 7], dtype=np.uint64)
        f["neg"] = np.array([0, 2**63 - 1], dtype=np.uint64)
        f["same"] = np.array([0, 2**63 - 1], dtype=np.uint64)
    with h5py.File(c, "w") as f:  # int64 against int64: the path that was exact already
        f["x"] = np.array([2**62, 7], dtype=np.int64)
    for first, second in ((a, b), (b, a)):
        rows = {r["name"]: r for r in _json("inspect", first, "--diff", second,
                                            "--json")["diff"]["datasets"]}
        assert rows["/x"]["status"] == "differs" and rows["/x"]["max_abs_diff"] == 1.0, rows
        assert rows["/neg"]["status"] == "differs" and rows["/neg"]["max_abs_diff"] == 1.0
        assert rows["/same"]["status"] == "equal" and rows["/same"]["max_abs_diff"] == 0.0
    (row,) = [r for r in _json("inspect", a, "--diff", c, "--json")["diff"]["datasets"]
              if r["name"] == "/x"]
    assert row["status"] == "differs" and row["max_abs_diff"] == 1.0


def test_a_link_to_the_root_inside_params_is_named_and_nothing_read_through_it(
        tmp_path, monkeypatch):
    """/params/x/y/root, a hard link to the root: load_params and
    params_nbytes name it as an alias of '/', and no dataset outside
    /params (/aaa, before params in the root) is read through it. Before:
    the message named '/params/x/y/root/params' as an alias of '/params',
    after load_params had read /aaa whole."""
    from purine_mpi.job import checkpoint_file
    path = tmp_path / "root.h5"
    with h5py.File(path, "w") as f:
        f["aaa"] = np.zeros(1000)
        f["params/a/weight"] = np.arange(4.0)
        f.create_group("params/x/y")["root"] = f["/"]
    read = []
    real = checkpoint_file._read_dataset
    monkeypatch.setattr(checkpoint_file, "_read_dataset",
                        lambda dset, kind: read.append(dset.name) or real(dset, kind))
    for load in (checkpoint_file.load_params, checkpoint_file.params_nbytes):
        with pytest.raises(UserError) as e:
            load(str(path))
        message = str(e.value)
        assert "'/params/x/y/root' is an alias of '/'," in message, message
        assert "cycle" in message and "\n" not in message, message
    assert read == ["/params/a/weight"], read


def test_text_diff_aligns_a_name_reached_through_a_group_alias(tmp_path):
    """/hh a soft link to the group /g against a file where /hh/longer_name
    is a copy: the diff's rows, that name's too, have their figures in one
    column. Before: ``len({len(r) for r in table}) == 1`` failed, the
    figures of /hh/longer_name a column further right (the width was the
    listing's, which does not hold that name)."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:
        f["g/longer_name"] = np.ones(3)
        f["hh"] = h5py.SoftLink("/g")
    with h5py.File(b, "w") as f:
        f["g/longer_name"] = np.ones(3)
        f["hh/longer_name"] = np.ones(3)
    res = run_cli_here("inspect", a, "--diff", b)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rows = lines[lines.index(next(r for r in lines if r.startswith("diff against"))) + 1:]
    table = [r for r in rows if r.startswith(("dataset", "/"))]
    assert [r.split()[0] for r in table] == ["dataset", "/g/longer_name", "/hh/longer_name"]
    assert len({len(r) for r in table}) == 1, table


def test_a_download_through_a_dangling_link_makes_nothing(tmp_path, monkeypatch):
    """The cache folder dl/cache, dl a dangling link to missing/deep: one
    line naming the folder, and the link's target is not made (as ``mkdir
    -p`` and the run folder refuse it). Before: ``pytest.raises(UserError)``
    failed: fetch made missing/deep/cache through the link (realpath) and
    downloaded there."""
    from purine_mpi.data.download import download_cifar10
    src = tmp_path / "src" / "cifar-10-batches-py"
    src.mkdir(parents=True)
    (src / "data_batch_1").write_bytes(b"x")
    archive = tmp_path / "c.tar.gz"
    import tarfile
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname="cifar-10-batches-py")
    monkeypatch.setenv("PURINE_CIFAR10_URL", archive.as_uri())
    monkeypatch.setenv("PURINE_CIFAR10_MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(tmp_path / "missing" / "deep", work / "dl")
    with pytest.raises(UserError) as e:
        download_cifar10(str(work / "dl" / "cache"))
    assert "dl/cache" in str(e.value) and "cannot make this folder" in str(e.value), str(e.value)
    assert not os.path.lexists(tmp_path / "missing")
    # through link/.. the download lands beside the link's target, as before
    os.makedirs(tmp_path / "far" / "a")
    os.symlink(tmp_path / "far" / "a", work / "link")
    got = download_cifar10(str(work / "link" / ".." / "new"))
    assert os.path.isfile(tmp_path / "far" / "new" / "cifar-10-batches-py" / "data_batch_1")
    assert os.path.samefile(got, tmp_path / "far" / "new" / "cifar-10-batches-py")
    assert sorted(os.listdir(work)) == ["dl", "link"]


def test_outputs_through_link_dotdot_are_written_beside_the_links_target(tmp_path):
    """``link/../new/FILE``, link a folder elsewhere: a checkpoint, a data
    file (``data digits --out``) and ``check_writable`` make ``new`` where
    the system writes the file (beside the link's target), and no folder
    beside the link. Before: ``data digits`` exited 2 ("cannot be written
    there") leaving work/nd empty, and save_checkpoint failed
    (FileNotFoundError on its temporary file) after making work/new."""
    from purine_mpi.base.runfiles import check_writable
    from purine_mpi.job.checkpoint_file import load_params, save_checkpoint
    work, far = tmp_path / "work", tmp_path / "far" / "a"
    work.mkdir()
    far.mkdir(parents=True)
    os.symlink(far, work / "link")
    save_checkpoint(str(work / "link" / ".." / "new" / "c.h5"), {"fc/weight": np.ones(2)})
    assert load_params(str(tmp_path / "far" / "new" / "c.h5"))["fc/weight"].tolist() == [1, 1]
    res = run_cli_here("data", "digits", "--out", work / "link" / ".." / "nd" / "d.h5")
    assert res.returncode == 0, res.stderr
    assert os.path.isfile(tmp_path / "far" / "nd" / "d.h5")
    check_writable(str(work / "link" / ".." / "other" / "x.h5"))
    assert not os.path.lexists(tmp_path / "far" / "other")  # the check leaves nothing
    assert sorted(os.listdir(work)) == ["link"]
    assert sorted(os.listdir(tmp_path / "far")) == ["a", "nd", "new"]


def _doubling(path, n):
    """/params/g0 .. g{n-1}, each but the last holding two hard links (a,
    b) to the next, the last one dataset of 8 bytes: 2**n names of it."""
    with h5py.File(path, "w") as f:
        groups = [f.create_group(f"params/g{i}") for i in range(n)]
        groups[-1]["w"] = np.ones(1)
        for here, below in zip(groups, groups[1:]):
            here["a"] = below
            here["b"] = below
    return str(path)


def test_params_nbytes_counts_names_without_walking_each(tmp_path, monkeypatch):
    """``plan --init``'s size of a weights file whose groups each link twice
    to the next: every name counted (8 * (2**n - 1) bytes, as load_params
    would read them), but each group looked at once. Before: the count
    walked every name, ``len(calls) <= 3 * n`` failed (8179 calls for n = 12;
    n = 16 took 56 s, n = 40 would never end), where cf6ed78's object walk
    took a moment."""
    from purine_mpi.job import checkpoint_file
    real, calls = checkpoint_file._group_nbytes, []
    monkeypatch.setattr(checkpoint_file, "_group_nbytes",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    n = 12
    assert checkpoint_file.params_nbytes(_doubling(tmp_path / "d12.h5", n)) == 8 * (2**n - 1)
    assert len(calls) <= 3 * n, len(calls)  # each group: once per link to it
    assert checkpoint_file.params_nbytes(_doubling(tmp_path / "d40.h5", 40)) == 8 * (2**40 - 1)
