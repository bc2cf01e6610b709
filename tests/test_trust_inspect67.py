"""``inspect`` on crafted and odd but valid HDF5 files (session 67): names
and values a file holds cannot write terminal escapes or lines of their own;
``--diff`` of identical copies never says "differs" (references compare by
what they point to, records field by field with NaN equal to NaN); a file
of many small datasets is walked without h5py's per-name look-ups; links,
filters, names that are not UTF-8 and unreadable files give a listing or one
clear error. Each test failed on adbcf87 (the assertion named in its text)."""
import json
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from tests.conftest import PYTHON, REPO, cli_env, run_cli_here

#: what a terminal acts on: ESC, CR, LF, the C1 CSI, a line separator, a bidi override
_RAW = ("\x1b", "\r", "\x9b", "\u2028", "\u202e", "\x07")


def _ok(res):
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    return res.stdout


def _refused(res, *words):
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "Traceback" not in text, text
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    for word in words:
        assert word in text, (word, text)


def test_names_and_values_cannot_inject_escapes_or_lines(tmp_path):
    """Attribute names (and values, group and dataset names, string values)
    holding ESC sequences, CR, LF, CSI and Unicode separators are shown
    escaped: the output has exactly its own lines and no control character.
    Before: ``"\\x1b" not in out`` failed (an attribute's name and value and
    a string dataset's value went out raw: ``@evil`` + a fake line)."""
    path = tmp_path / "evil.h5"
    with h5py.File(path, "w") as f:
        f.attrs["evil\nfake line\x1b[31mRED\r\x9b2J\u2028\u202e"] = 1
        f.attrs["value"] = "v\x1b[31mRED\rX\x07"
        f.attrs["grid"] = np.arange(12).reshape(3, 4)  # NumPy prints it on three lines
        g = f.create_group("g\x1b[2J\nline")
        g["d\x1b[31m"] = np.arange(3.0)
        g["s"] = "text\x1b]0;title\x07\rred"
    other = tmp_path / "other.h5"
    shutil.copy(path, other)
    with h5py.File(other, "a") as f:
        f.attrs["value"] = "w\x1b[32m"
    out = _ok(run_cli_here("inspect", path, "--diff", other))
    for raw in _RAW:
        assert raw not in out, (raw, out)
    lines = out.splitlines()
    # file, 3 attributes, header, 2 datasets; diff header 2, 2 rows, 1 attribute
    assert len(lines) == 12, out
    assert "  @evil\\nfake line\\x1b[31mRED\\r\\x9b2J\\u2028\\u202e = 1" in lines, out
    assert "  @value = v\\x1b[31mRED\\rX\\x07" in lines, out
    assert "  @grid = [[ 0  1  2  3] [ 4  5  6  7] [ 8  9 10 11]]" in lines, out
    assert any(r.startswith("/g\\x1b[2J\\nline/s ") and "text\\x1b]0;title\\x07\\rred" in r
               for r in lines), out
    assert "attribute @value: v\\x1b[31mRED\\rX\\x07 vs w\\x1b[32m" in lines, out
    # the JSON keeps names and values as they are (its own escapes)
    report = json.loads(_ok(run_cli_here("inspect", path, "--json")))
    assert report["attrs"]["value"] == "v\x1b[31mRED\rX\x07"
    assert "evil\nfake line\x1b[31mRED\r\x9b2J\u2028\u202e" in report["attrs"]


def test_a_long_attribute_is_one_cut_line(tmp_path):
    """An attribute of 1 MiB of text is shown as 200 characters and its
    length; the JSON has all of it. Before: the line held all 1,048,576
    characters (``len(line) < 300`` failed)."""
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f.attrs["big"] = "x" * (1 << 20)
        f["d"] = np.ones(2)
    (line,) = [r for r in _ok(run_cli_here("inspect", path)).splitlines() if "@big" in r]
    assert len(line) < 300 and line.endswith("... (1,048,576 characters)"), line[:400]
    report = json.loads(_ok(run_cli_here("inspect", path, "--json")))
    assert report["attrs"]["big"] == "x" * (1 << 20)


def test_an_attribute_over_the_read_limit_is_not_read(tmp_path, monkeypatch):
    """An attribute larger than the most inspect reads at a time
    (BLOCK_BYTES, lowered here to 1,000 bytes) is shown by its size,
    unread. Before: ``== "<8,000 bytes, not read>"`` failed (all of it)."""
    from purine_mpi.tools import inspect
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f.attrs["big"] = np.arange(1000.0)
        f.attrs["small"] = np.arange(3.0)
    monkeypatch.setattr(inspect, "BLOCK_BYTES", 1000)
    report = json.loads(_ok(run_cli_here("inspect", path, "--json")))
    assert report["attrs"]["big"] == "<8,000 bytes, not read>"
    assert report["attrs"]["small"] == [0.0, 1.0, 2.0]


def _exotic(path, target="a", region=slice(2, 5)):
    with h5py.File(path, "w") as f:
        f["a"] = np.arange(10.0)
        f["b"] = np.arange(4.0)
        refs = f.create_dataset("refs", shape=(3,), dtype=h5py.ref_dtype)
        refs[0], refs[1] = f[target].ref, f["/"].ref  # refs[2]: a null reference
        f.create_dataset("one_ref", data=f[target].ref, dtype=h5py.ref_dtype)
        regions = f.create_dataset("regions", shape=(1,), dtype=h5py.regionref_dtype)
        regions[0] = f["a"].regionref[region]
        f.attrs["ref"] = f[target].ref
        rec = np.zeros(3, dtype=[("x", "f4"), ("y", "i4"), ("v", "f8", (2,))])
        rec["x"], rec["v"][1] = [1.0, np.nan, 3.0], [np.nan, 2.0]
        f["records"] = rec
        f.create_dataset("enum", data=np.array([0, 1, 1], "i1"),
                         dtype=h5py.enum_dtype({"A": 0, "B": 1}, basetype="i1"))
        f.create_dataset("strings", data=["a", "\u00e9t\u00e9"], dtype=h5py.string_dtype())
        f.create_dataset("empty", shape=(0,), dtype="f4")
        f["scalar"] = 3.5
        f["nan"] = np.array([1.0, np.nan, np.inf])
        f["complex"] = np.array([1 + 2j, np.nan])
        sequences = np.array([np.arange(2.0), np.array([np.nan])], dtype=object)
        f.create_dataset("vlen", data=sequences, dtype=h5py.vlen_dtype("f8"))
        f.attrs["empty"] = h5py.Empty("f4")
        f.attrs["nan"] = np.nan


def test_diff_of_identical_exotic_datasets_is_equal(tmp_path):
    """References (object, region, scalar, null, in an attribute), records
    holding NaN, enums, variable-length strings and numbers, empty, scalar,
    NaN and complex datasets and h5py.Empty attributes: --diff of a copy
    finds every one equal. Before: ``row.get("equal", True) is True``
    failed for /one_ref ("differs": references compared by identity; the
    references and records rows too, the records for their NaN)."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    _exotic(a)
    _exotic(b)  # written again: the same content, not the same bytes
    report = json.loads(_ok(run_cli_here("inspect", a, "--diff", b, "--json")))
    diff = report["diff"]
    rows = {r["name"]: r for r in diff["datasets"]}
    assert set(rows) == {"/a", "/b", "/refs", "/one_ref", "/regions", "/records", "/enum",
                         "/strings", "/empty", "/scalar", "/nan", "/complex", "/vlen"}
    for name, row in rows.items():
        assert row.get("equal", True) is True, row
        assert row.get("max_abs_diff", 0.0) == 0.0 and row.get("rel_l2_diff", 0.0) == 0.0, row
    assert diff["attrs"] == {} and not diff["only_in_first"] and not diff["only_in_second"]
    shown = {d["name"]: d for d in report["datasets"]}
    assert shown["/refs"]["dtype"] == "object reference"
    assert shown["/regions"]["dtype"] == "region reference"
    assert report["attrs"]["ref"] == "<reference to /a>"
    text = _ok(run_cli_here("inspect", a, "--diff", b))
    assert "differs" not in text, text


def test_diff_of_references_to_other_targets_differs(tmp_path):
    """The same datasets where the references point elsewhere (another
    dataset, another region): those rows say "differs", the rest equal.
    Before: the list of rows not equal also held /records (its NaN)."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    _exotic(a)
    _exotic(b, target="b", region=slice(2, 6))
    report = json.loads(_ok(run_cli_here("inspect", a, "--diff", b, "--json")))
    rows = {r["name"]: r for r in report["diff"]["datasets"]}
    assert [n for n, r in rows.items() if r.get("equal") is False] == \
        ["/one_ref", "/refs", "/regions"]
    assert report["diff"]["attrs"] == {"ref": ["<reference to /a>", "<reference to /b>"]}


def test_records_holding_references_are_not_compared(tmp_path):
    """A record with a reference field: --diff says plainly that it is not
    compared (never "differs" for a copy). Before: ``row["equal"] is None``
    failed (False: "differs")."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    for path in (a, b):
        with h5py.File(path, "w") as f:
            f["x"] = np.ones(2)
            rec = np.zeros(1, dtype=[("r", h5py.ref_dtype), ("w", "f4")])
            rec["r"][0] = f["x"].ref
            f["rec"] = rec
    report = json.loads(_ok(run_cli_here("inspect", a, "--diff", b, "--json")))
    (row,) = [r for r in report["diff"]["datasets"] if r["name"] == "/rec"]
    assert row["equal"] is None and "references" in row["not_compared"], row
    text = _ok(run_cli_here("inspect", a, "--diff", b))
    assert any(r.startswith("/rec ") and r.endswith("not compared (holds HDF5 references)")
               for r in text.splitlines()), text


def test_many_small_datasets_build_no_h5py_dataset(tmp_path, monkeypatch):
    """2,000 small datasets in 20 groups: the listing is the one h5py's own
    walk gives (names, order, figures), and the walk builds no
    h5py.Dataset per name (HDF5's link visit and the datasets' own ids):
    what made 20,000 of them take ~50 s. Before: ``built == []`` failed
    (4,000 Datasets built: the link check and visititems, one each)."""
    path = tmp_path / "many.h5"
    rng = np.random.default_rng(0)
    expected = {}
    with h5py.File(path, "w") as f:
        for i in range(2000):
            name = f"g{i % 20}/d{i}"
            f[name] = rng.standard_normal(3).astype(np.float32)
            expected["/" + name] = f[name][...]
    built = []
    init = h5py.Dataset.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)
    monkeypatch.setattr(h5py.Dataset, "__init__", counting)
    report = json.loads(_ok(run_cli_here("inspect", path, "--json")))
    assert built == []
    order = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: order.append("/" + n) if isinstance(o, h5py.Dataset) else None)
    assert [d["name"] for d in report["datasets"]] == order
    for d in report["datasets"]:
        x = expected[d["name"]].astype(np.float64)
        assert d["min"] == x.min() and d["max"] == x.max(), d
        assert d["mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert d["l2"] == pytest.approx(np.sqrt((x * x).sum()), rel=1e-12)


def test_every_name_of_a_dataset_is_listed(tmp_path):
    """A dataset with two hard links and a soft link to it: all three
    names are listed, the dataset under its first with its figures, the
    others as aliases of it (session 68: not as datasets of their own), so
    --diff against a file holding three separate copies compares each name
    and finds nothing only in one file. Before: ``names == [...]`` failed
    (only /a: HDF5's object walk)."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:
        f["a"] = np.arange(3.0)
        f["b"] = f["a"]
        f["s"] = h5py.SoftLink("/a")
        f.create_group("g")["x"] = np.ones(1)
        f["sg"] = h5py.SoftLink("/g")  # a soft link to a group: not a dataset
    with h5py.File(b, "w") as f:
        for name in ("a", "b", "s"):
            f[name] = np.arange(3.0)
        f.create_group("g")["x"] = np.ones(1)
    report = json.loads(_ok(run_cli_here("inspect", a, "--diff", b, "--json")))
    names = [d["name"] for d in report["datasets"]]
    assert names == ["/a", "/g/x"]
    assert report["datasets"][0]["l2"] == pytest.approx(np.sqrt(5.0))
    assert [(a["name"], a["alias_of"], a["link"]) for a in report["aliases"]] == [
        ("/b", "/a", "hard"), ("/s", "/a", "soft"), ("/sg", "/g", "soft")]
    assert not report["diff"]["only_in_first"] and not report["diff"]["only_in_second"]
    assert {r["name"]: r["status"] for r in report["diff"]["datasets"]} == {
        "/a": "equal", "/b": "equal", "/s": "equal", "/g/x": "equal"}


def test_names_that_are_not_utf8(tmp_path):
    """Dataset, group and attribute names of bytes that are not UTF-8 are
    listed with escapes (``caf\\xe9``). Before: ``returncode == 0`` failed
    (SystemError traceback from h5py's link walk)."""
    path = tmp_path / "latin1.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(b"caf\xe9", data=np.arange(3.0))
        f.create_group(b"g\xff").create_dataset("x", data=[1])
        f.attrs.create(b"at\xe9", 5)
    out = _ok(run_cli_here("inspect", path))
    assert "  @at\\xe9 = 5" in out.splitlines(), out
    assert any(r.startswith("/caf\\xe9 ") for r in out.splitlines()), out
    assert any(r.startswith("/g\\xff/x ") for r in out.splitlines()), out
    report = json.loads(_ok(run_cli_here("inspect", path, "--json", "--diff", path)))
    assert [d["name"] for d in report["datasets"]] == ["/caf\\xe9", "/g\\xff/x"]
    assert all(r["max_abs_diff"] == 0.0 for r in report["diff"]["datasets"])


def test_a_filter_this_hdf5_lacks_is_no_damage(tmp_path):
    """A dataset compressed with a filter this HDF5 does not have: listed
    as not read (naming the filter), the others with their figures; --diff
    says not compared. Before: ``returncode == 0`` failed (exit 2, the file
    called corrupt)."""
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    assert not h5py.h5z.filter_avail(32001)
    with h5py.File(a, "w") as f:
        d = f.create_dataset("x", shape=(4,), chunks=(4,), dtype="f4", compression=32001,
                             allow_unknown_filter=True)
        d.id.write_direct_chunk((0,), b"not blosc")
        f["y"] = np.arange(2.0)
    shutil.copy(a, b)
    out = _ok(run_cli_here("inspect", a, "--diff", b))
    assert any(r.startswith("/x ") and "<not read: HDF5 filter 32001" in r
               for r in out.splitlines()), out
    assert any(r.startswith("/x ") and r.endswith("not compared (HDF5 filter 32001 missing here)")
               for r in out.splitlines()), out
    assert "corrupt" not in out


def test_links_out_of_the_file_are_never_followed(tmp_path):
    """An external link and external storage naming a FIFO: inspect exits 2
    with one line naming them, without opening the FIFO (which would block
    until the timeout). A dangling soft link: one line too, its target's
    escape shown escaped. Before: the dangling link's line held the raw
    ESC (``... to '/nothing\\x1b[31m'`` not in it)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {}
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f["a"] = np.ones(2)
        f["e"] = h5py.ExternalLink(str(fifo), "/x")
    cases["ext.h5"] = ("'/e' is an external link", str(fifo))
    with h5py.File(tmp_path / "storage.h5", "w") as f:
        f.create_dataset("p", shape=(4,), dtype="u1", external=[(str(fifo), 0, 4)])
    cases["storage.h5"] = ("'/p' is stored in external file(s)", str(fifo))
    with h5py.File(tmp_path / "dangling.h5", "w") as f:
        f["s"] = h5py.SoftLink("/nothing\x1b[31m")
    cases["dangling.h5"] = ("'/s' is a dangling soft link to '/nothing\\x1b[31m'",)
    for name, words in cases.items():
        res = subprocess.run([PYTHON, "-m", "purine_mpi", "inspect", str(tmp_path / name)],
                             cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
        _refused(res, *words)
        assert "\x1b" not in res.stderr


def test_files_that_cannot_be_inspected(tmp_path, monkeypatch):
    """Not HDF5, empty, a folder, missing, a named pipe, unreadable: one
    line each, exit 2 (before, the pipe hung: TimeoutExpired). The
    unreadable file is simulated (the tests may run as root, who reads any
    file): Python's open raising PermissionError, which inspect
    now tries before HDF5. Before: exit 0 (HDF5 was the first to open the
    file; for another user HDF5's failed open was left to its "not HDF5" /
    "corrupt" messages, not verified here as root)."""
    (tmp_path / "text.h5").write_text("hello")
    (tmp_path / "empty.h5").write_bytes(b"")
    (tmp_path / "dir.h5").mkdir()
    for name, words in (("text.h5", "is not an HDF5 file"), ("empty.h5", "is not an HDF5 file"),
                        ("dir.h5", "is a directory"), ("missing.h5", "not found")):
        _refused(run_cli_here("inspect", tmp_path / name), str(tmp_path / name), words)
    os.mkfifo(tmp_path / "fifo.h5")  # no writer: opening it would wait for ever
    res = subprocess.run([PYTHON, "-m", "purine_mpi", "inspect", str(tmp_path / "fifo.h5")],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
    _refused(res, str(tmp_path / "fifo.h5"), "is a pipe or socket")
    good = tmp_path / "good.h5"
    with h5py.File(good, "w") as f:
        f["a"] = np.ones(2)
    from purine_mpi.job import checkpoint_file
    real_open = open

    def denied(path, *args, **kwargs):  # as a file of another user (the tests may run as root)
        if str(path) == str(good):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(checkpoint_file, "open", denied, raising=False)
    _refused(run_cli_here("inspect", good), str(good), "cannot be read: Permission denied")
