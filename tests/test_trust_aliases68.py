"""Second names in HDF5 files and the files around them (session 68):
``inspect`` lists each object once and every other name of it as ``alias
of /x`` (a group hard-linked twice, into itself or to its own parent
included: the walk ends); ``--diff --json`` rows carry ``status``
("equal", "differs", "not_compared") beside ``equal``; loading a weights
file whose group is its own parent names the alias; ``hdf5_kind`` opens an
existing ``--out`` once; a failed download through ``link/..`` leaves no
folder behind. Each test failed on cf6ed78 (the assertion named in its
text)."""
import functools
import json
import os
import types

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from tests.conftest import run_cli_args, run_cli_here


def _ok(res):
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    return res.stdout


def _aliased(path, shift=0.0):
    """/params/a/weight; /params/b a second hard link to the group
    /params/a; /params/w2 a second hard link to the dataset; /params/s a
    soft link to it."""
    with h5py.File(path, "w") as f:
        g = f.create_group("params/a")
        g["weight"] = np.arange(4.0) + shift
        f["params/b"] = g
        f["params/w2"] = g["weight"]
        f["params/s"] = h5py.SoftLink("/params/a/weight")
    return path


def _cyclic(path):
    """/params/a/up a hard link to the root, /params/a/self one to /params/a
    itself: names without end for a walk that follows them."""
    with h5py.File(path, "w") as f:
        g = f.create_group("params/a")
        g["weight"] = np.arange(4.0)
        g["up"] = f["/"]
        g["self"] = g
    return path


def test_inspect_lists_each_object_once_and_its_other_names_as_aliases(tmp_path):
    """The group /params/b (a second name of /params/a) is said to be an
    alias, and the dataset's second names are listed as aliases of its
    first, not as datasets of their own with the same figures. Before:
    ``report["aliases"]`` failed (KeyError: /params/b was not mentioned at
    all, /params/w2 and /params/s listed as datasets)."""
    path = _aliased(tmp_path / "a.h5")
    report = json.loads(_ok(run_cli_here("inspect", path, "--json")))
    assert [d["name"] for d in report["datasets"]] == ["/params/a/weight"]
    assert report["aliases"] == [
        {"name": "/params/b", "alias_of": "/params/a", "kind": "group", "link": "hard"},
        {"name": "/params/s", "alias_of": "/params/a/weight", "kind": "dataset",
         "link": "soft"},
        {"name": "/params/w2", "alias_of": "/params/a/weight", "kind": "dataset",
         "link": "hard"}]
    lines = _ok(run_cli_here("inspect", path)).splitlines()
    assert any(r.startswith("/params/b ") and r.endswith("alias of /params/a (a group)")
               for r in lines), lines
    assert any(r.startswith("/params/w2 ") and r.endswith("alias of /params/a/weight")
               for r in lines), lines
    assert any(r.startswith("/params/s ") and
               r.endswith("alias of /params/a/weight (soft link)") for r in lines), lines


def test_inspect_and_diff_of_a_group_that_contains_its_parent_end(tmp_path):
    """A group hard-linked to the root inside itself, and to itself: inspect
    and inspect --diff (either way round, text and JSON) end, listing the
    dataset once and the two names as aliases of / and /params/a. Run as a
    process with a time limit: a walk without end fails the test, never
    hangs it. Before: ``"alias of /" in out`` failed (neither name said)."""
    loop, other = _cyclic(tmp_path / "loop.h5"), _aliased(tmp_path / "b.h5")
    out = _ok(run_cli_args("inspect", loop, "--diff", other, timeout=60))
    lines = out.splitlines()
    assert any(r.startswith("/params/a/up ") and r.endswith("alias of / (a group)")
               for r in lines), out
    assert any(r.startswith("/params/a/self ") and r.endswith("alias of /params/a (a group)")
               for r in lines), out
    report = json.loads(_ok(run_cli_args("inspect", other, "--diff", loop, "--json",
                                         timeout=60)))
    diff = report["diff"]
    assert [(r["name"], r["status"]) for r in diff["datasets"]] == [("/params/a/weight",
                                                                     "equal")]
    # the second names of the dataset in b.h5 are no dataset of loop.h5
    assert diff["only_in_first"] == ["/params/s", "/params/w2"] and not diff["only_in_second"]
    assert {a["name"]: (a["first"], a["second"]) for a in diff["aliases"]} == {
        "/params/b": ("/params/a", None), "/params/s": ("/params/a/weight", None),
        "/params/w2": ("/params/a/weight", None), "/params/a/up": (None, "/"),
        "/params/a/self": (None, "/params/a")}


def test_diff_compares_an_alias_against_a_copy_and_not_an_alias_twice(tmp_path):
    """Two files with the same second names: the dataset is compared once
    (at its first name), no alias difference. Against a file holding
    copies under those names, each name is compared with the copy and the
    alias difference is named; a copy that differs is found. Before:
    ``names == ["/params/a/weight"]`` failed (/params/s and /params/w2 compared
    as datasets of their own)."""
    a, b = _aliased(tmp_path / "a.h5"), _aliased(tmp_path / "b.h5", shift=1.0)
    diff = json.loads(_ok(run_cli_here("inspect", a, "--diff", b, "--json")))["diff"]
    names = [r["name"] for r in diff["datasets"]]
    assert names == ["/params/a/weight"], diff
    assert diff["datasets"][0]["status"] == "differs" and diff["aliases"] == []
    copies = tmp_path / "copies.h5"
    with h5py.File(copies, "w") as f:
        for name in ("params/a/weight", "params/b/weight", "params/w2", "params/s"):
            f[name] = np.arange(4.0)
        f["params/w2"][1] = 7.0
    diff = json.loads(_ok(run_cli_here("inspect", a, "--diff", copies, "--json")))["diff"]
    rows = {r["name"]: r["status"] for r in diff["datasets"]}
    assert rows == {"/params/a/weight": "equal", "/params/b/weight": "equal",
                    "/params/w2": "differs", "/params/s": "equal"}, diff
    assert not diff["only_in_first"] and not diff["only_in_second"], diff
    assert {a["name"] for a in diff["aliases"]} == {"/params/b", "/params/w2", "/params/s"}


def test_every_diff_row_has_a_status_beside_equal(tmp_path, monkeypatch):
    """A row inspect does not compare (more references than MAX_REFS) has
    ``equal`` null and ``status`` "not_compared"; numeric rows too carry
    ``equal`` and ``status``; a NaN on one side only is "differs". Before:
    ``row["status"]`` failed (KeyError)."""
    from purine_mpi.tools import inspect
    monkeypatch.setattr(inspect, "MAX_REFS", 1)
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path, last in ((a, 2.0), (b, np.nan)):
        with h5py.File(path, "w") as f:
            f["x"] = np.array([1.0, last])
            f["same"] = np.arange(3)
            f["text"] = "hello"
            f["shape"] = np.zeros(2 if path == a else 3)
            refs = f.create_dataset("refs", (2,), dtype=h5py.ref_dtype)
            refs[0] = refs[1] = f["x"].ref
    diff = json.loads(inspect.inspect_checkpoint(str(a), diff=str(b), as_json=True))["diff"]
    rows = {r["name"]: (r["equal"], r["status"]) for r in diff["datasets"]}
    assert rows == {"/x": (False, "differs"), "/same": (True, "equal"),
                    "/text": (True, "equal"), "/shape": (False, "differs"),
                    "/refs": (None, "not_compared")}, rows


def test_loading_a_group_that_is_its_own_parent_names_the_alias(tmp_path):
    """load_params on /params/a/self, a second name of /params/a inside it:
    one short line naming the name, the group it is an alias of and the
    cycle. Before: ``"alias of '/params/a'" in message`` failed."""
    from purine_mpi.job.checkpoint_file import load_params
    with pytest.raises(UserError) as e:
        load_params(str(_cyclic(tmp_path / "loop.h5")))
    message = str(e.value)
    assert "'/params/a/self'" in message and "alias of '/params/a'" in message, message
    assert "cycle" in message and len(message) < 400, message


def test_missing_filter_uses_the_walks_creation_properties(tmp_path):
    """inspect's filter check reads the dataset's creation properties the
    walk fetched, not HDF5 again. Before: ``_missing_filter(d) is None``
    raised AttributeError (get_create_plist asked again)."""
    from purine_mpi.tools.inspect import _Dataset, _missing_filter
    path = tmp_path / "z.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(64.0), chunks=(8,), compression="gzip")
    with h5py.File(path, "r") as f:
        oid = f["x"].id
        d = _Dataset(oid, oid.get_create_plist())
        d.id = types.SimpleNamespace()  # any look-up through the id fails
        assert _missing_filter(d) is None


def _checkpoint_like(path, userblock=0):
    with h5py.File(path, "w", userblock_size=userblock) as f:
        from purine_mpi.job.checkpoint_file import FORMAT
        f.attrs["format"] = FORMAT
        f["params/fc/weight"] = np.ones(2)
    return str(path)


def test_hdf5_kind_opens_the_file_once_and_keeps_the_user_block_rule(tmp_path, monkeypatch):
    """A file with our checkpoint's format attribute is a checkpoint when
    HDF5's signature starts it, and HDF5 data of another kind with a user
    block before it (as is_our_checkpoint says), each from one open, as a
    data file is. Before: ``opened == [data]`` failed (two opens: one by
    is_our_checkpoint, which the two others already had)."""
    from purine_mpi.job import outputs
    from purine_mpi.job.rundir_force import is_our_checkpoint
    plain = _checkpoint_like(tmp_path / "plain.h5")
    blocked = _checkpoint_like(tmp_path / "blocked.h5", userblock=512)
    assert is_our_checkpoint(plain) and not is_our_checkpoint(blocked)
    opened, real = [], h5py.File

    def counting(name, *args, **kwargs):
        opened.append(str(name))
        return real(name, *args, **kwargs)
    monkeypatch.setattr(h5py, "File", counting)
    assert outputs.hdf5_kind(plain) == ("checkpoint", "")
    assert opened == [plain]
    opened.clear()
    assert outputs.hdf5_kind(blocked) == ("other", "top level: params")
    assert opened == [blocked]
    data = str(tmp_path / "data.h5")
    with real(data, "w") as f:
        f["data"], f["label"] = np.zeros((2, 3)), np.zeros(2)
    opened.clear()
    assert outputs.hdf5_kind(data) == ("data", "top level: data, label")
    assert opened == [data]
    os.symlink(plain, tmp_path / "link.h5")  # through a link: never taken for ours
    assert outputs.hdf5_kind(str(tmp_path / "link.h5")) == ("other", "top level: params")


def test_a_failed_download_through_a_link_and_dotdot_leaves_no_folder(tmp_path, monkeypatch):
    """The cache folder ``work/link/../new``, link a symbolic link to
    real/dir: the system puts ``new`` in real/, beside the link's target.
    A download with a wrong checksum (or from a server that refuses) is
    refused and leaves no folder there nor in work/. Before: ``"MD5" in
    message`` failed (the folder was made in work/, lexically, so the part
    file could not be written: "could not download")."""
    import http.server
    import threading
    from purine_mpi.data.download import download_cifar10
    www = tmp_path / "www"
    www.mkdir()
    (www / "c.tar.gz").write_bytes(b"not the archive")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(Quiet, directory=str(www)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    (tmp_path / "real" / "dir").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    os.symlink(tmp_path / "real" / "dir", tmp_path / "work" / "link")
    cache = os.path.join(str(tmp_path), "work", "link", "..", "new", "deeper")
    try:
        monkeypatch.setenv("PURINE_CIFAR10_URL", f"http://127.0.0.1:{httpd.server_address[1]}"
                                                 "/c.tar.gz")
        monkeypatch.setenv("PURINE_CIFAR10_MD5", "0" * 32)
        with pytest.raises(UserError) as e:
            download_cifar10(cache)
        assert "MD5" in str(e.value), str(e.value)
        assert sorted(os.listdir(tmp_path / "real")) == ["dir"]
        assert sorted(os.listdir(tmp_path / "work")) == ["link"]
        monkeypatch.setenv("PURINE_CIFAR10_URL", f"http://127.0.0.1:{httpd.server_address[1]}"
                                                 "/none.tar.gz")  # 404
        with pytest.raises(UserError, match="could not download"):
            download_cifar10(cache)
        assert sorted(os.listdir(tmp_path / "real")) == ["dir"]
        assert sorted(os.listdir(tmp_path / "work")) == ["link"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_params_nbytes_counts_each_name_as_load_params_reads_it(tmp_path):
    """``plan --init``'s size of a weights file: a dataset under four names
    (its own, through a second name of its group, a second hard link, a
    soft link) is read four times by load_params and counted so; a group that is its own
    parent is refused as load_params refuses it. Before: ``nbytes == read``
    failed (32 == 128: HDF5's object walk counted the dataset once)."""
    from purine_mpi.job.checkpoint_file import load_params, params_nbytes
    path = str(_aliased(tmp_path / "a.h5"))
    read = sum(np.asarray(v).nbytes for v in load_params(path).values())
    assert read == 4 * 32
    nbytes = params_nbytes(path)
    assert nbytes == read
    with pytest.raises(UserError) as e:
        params_nbytes(str(_cyclic(tmp_path / "loop.h5")))
    assert "alias of '/params/a'" in str(e.value) and "cycle" in str(e.value), str(e.value)
