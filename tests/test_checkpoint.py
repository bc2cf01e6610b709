"""HDF5 checkpoints: exact round trip, atomic writes, clear errors, inspect."""
import json
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.job.checkpoint_file import FORMAT, load_checkpoint, load_params, save_checkpoint
from purine_mpi.job.run_checkpoints import find_latest, save_run_checkpoint
from purine_mpi.tools.inspect import inspect_checkpoint


def example(seed=0):
    rng = np.random.default_rng(seed)
    weird = np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)
    weird.view(np.uint32)[0] |= 0x12345  # a NaN payload must survive too
    params = {"conv1/weight": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
              "conv1/bias": weird,
              "fc1/weight": rng.standard_normal((3, 5)),  # float64
              "bn/running": rng.standard_normal(2).astype(np.float16)}
    solver = {name: {"momentum": np.full_like(value, 0.5)} for name, value in params.items()}
    state = {
        "rng": {"dropout1": np.random.default_rng(9).bit_generator.state},  # 128-bit ints
        "data": {"train": {"position": 12, "global_batch": 8, "seed": 0}},
        "ops": {"drop": {"mask_seed": np.uint64(2 ** 63 + 5), "hist": np.arange(6).reshape(2, 3)}},
        "lr": 0.012345678901234567, "phase": "train", "flag": True, "nothing": None,
        "bools": np.array([True, False]), "zero_d": np.array(3.5), "empty": np.zeros((0, 4)),
        "list": [1, 2.5, "x"],
    }
    return params, solver, state


def assert_same(a, b, where="."):
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{where}: bits differ"
    else:
        assert a == b, where


def test_round_trip_is_bitwise(tmp_path):
    params, solver, state = example()
    path = str(tmp_path / "c.h5")
    save_checkpoint(path, params, solver, state, iteration=42, world_size=4, seed=7,
                    config_text="name: x\nsolver: {base_lr: 0.1}\n")
    ckpt = load_checkpoint(path)
    assert_same(ckpt.params, params)
    assert_same(ckpt.solver, solver)
    assert_same(ckpt.state, state)
    assert ckpt.iteration == 42
    assert ckpt.attrs == {"format": FORMAT, "version": 1, "iteration": 42, "world_size": 4,
                          "seed": 7, "config": "name: x\nsolver: {base_lr: 0.1}\n"}
    # the restored generator continues the same stream
    gen = np.random.default_rng()
    gen.bit_generator.state = ckpt.state["rng"]["dropout1"]
    np.testing.assert_array_equal(gen.random(3), np.random.default_rng(9).random(3))
    assert_same(load_params(path), params)


def test_layout_is_plain_hdf5(tmp_path):
    params, solver, state = example()
    path = str(tmp_path / "c.h5")
    save_checkpoint(path, params, solver, state)
    names = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: names.append(name)
                     if isinstance(obj, h5py.Dataset) else None)
        np.testing.assert_array_equal(f["params/conv1/weight"][...], params["conv1/weight"])
        np.testing.assert_array_equal(f["solver/fc1/weight/momentum"][...], 0.5)
    assert "params/conv1/bias" in names and "state/rng" in names
    if shutil.which("h5ls"):
        listing = subprocess.run(["h5ls", "-r", path], capture_output=True, text=True,
                                 check=True).stdout
        assert "/params/conv1/weight" in listing and "Dataset {4, 1, 3, 3}" in listing


def test_atomic_write_leaves_no_temp(tmp_path):
    params, solver, state = example()
    path = tmp_path / "c.h5"
    save_checkpoint(str(path), params, solver, state, iteration=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]
    before = path.read_bytes()
    with pytest.raises(TypeError, match="state/bad"):
        save_checkpoint(str(path), params, solver, {"bad": object()}, iteration=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.h5"]
    assert path.read_bytes() == before  # a failed save leaves the old file whole


def test_run_checkpoints_latest_and_rotation(tmp_path):
    params, solver, state = example()
    out = str(tmp_path / "run")
    assert find_latest(out) is None
    for it in (5, 10, 15, 20):
        params["conv1/weight"][0, 0, 0, 0] = it
        save_run_checkpoint(out, it, keep=2, params=params, solver=solver, state=state)
    assert sorted(os.listdir(out)) == ["ckpt_15.h5", "ckpt_20.h5", "latest.h5"]
    latest = load_checkpoint(find_latest(out))
    assert latest.iteration == 20 and latest.params["conv1/weight"][0, 0, 0, 0] == 20
    save_run_checkpoint(out, 25, keep=0, params=params)  # keep 0: keep all
    assert len(os.listdir(out)) == 4


def test_bad_files_are_user_errors(tmp_path):
    params, solver, state = example()
    good = tmp_path / "good.h5"
    save_checkpoint(str(good), params, solver, state)
    cases = {"missing.h5": None, "text.h5": b"hello, not hdf5" * 10,
             "truncated.h5": good.read_bytes()[:len(good.read_bytes()) // 3]}
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError) as info:
            load_checkpoint(str(tmp_path / name))
        assert name in str(info.value)
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_checkpoint(str(tmp_path / "truncated.h5"))
    with pytest.raises(UserError, match="not an HDF5 file"):
        inspect_checkpoint(str(tmp_path / "text.h5"))
    foreign = str(tmp_path / "foreign.h5")
    with h5py.File(foreign, "w") as f:
        f["params/conv1/weight"] = np.ones((2, 2), np.float32)
    with pytest.raises(UserError, match="not a purine_mpi checkpoint"):
        load_checkpoint(foreign)
    # --init accepts any file with /params
    assert list(load_params(foreign)) == ["conv1/weight"]
    with h5py.File(foreign, "w") as f:
        f["weights"] = np.ones(2)
    with pytest.raises(UserError, match="no /params group"):
        load_params(foreign)


def test_corrupt_dataset_is_a_user_error(tmp_path):
    path = tmp_path / "c.h5"
    values = np.arange(100000, dtype=np.float64)
    save_checkpoint(str(path), {"w": values})
    raw = bytearray(path.read_bytes())
    at = raw.find(values[1000:1002].tobytes())
    raw[at] ^= 0xFF  # one flipped bit pattern inside the data: the checksum catches it
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="c.h5' is corrupt: reading '/params/w'"):
        load_checkpoint(str(path))


def test_inspect_and_diff(tmp_path):
    params, solver, state = example()
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    save_checkpoint(a, params, solver, state, iteration=3)
    other = dict(params, **{"conv1/weight": params["conv1/weight"] * 2, "extra": np.ones(2)})
    del other["bn/running"]
    save_checkpoint(b, other, iteration=4)
    text = inspect_checkpoint(a)
    assert "/params/conv1/weight" in text and "4x1x3x3" in text and "float32" in text
    assert "@iteration = 3" in text
    report = json.loads(inspect_checkpoint(a, as_json=True))
    entry = {d["name"]: d for d in report["datasets"]}["/params/fc1/weight"]
    w = params["fc1/weight"]
    assert entry["shape"] == [3, 5] and entry["dtype"] == "float64"
    np.testing.assert_allclose([entry[k] for k in ("min", "max", "mean", "std", "l2")],
                               [w.min(), w.max(), w.mean(), w.std(), np.linalg.norm(w)])
    diff = json.loads(inspect_checkpoint(a, diff=b, as_json=True))["diff"]
    rows = {r["name"]: r for r in diff["datasets"]}
    cw = params["conv1/weight"]
    assert rows["/params/conv1/weight"]["max_abs_diff"] == pytest.approx(np.abs(cw).max())
    assert rows["/params/conv1/weight"]["rel_l2_diff"] == pytest.approx(0.5)
    assert rows["/params/fc1/weight"]["max_abs_diff"] == 0
    assert "/params/bn/running" in diff["only_in_first"]
    assert diff["only_in_second"] == ["/params/extra"]
    assert diff["attrs"]["iteration"] == [3, 4]
    text = inspect_checkpoint(a, diff=b)
    assert "only in second: /params/extra" in text and "diff against" in text



def test_inspect_diff_of_integers_beyond_float64(tmp_path):
    """``inspect --diff`` subtracted in float64: two int64/uint64 datasets
    that float64 rounds to one value (2**62 + 1 and 2**62) read as equal,
    max_abs_diff 0. Now integers are subtracted exactly."""
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    with h5py.File(a, "w") as f:
        f["i"] = np.array([2 ** 62 + 1, 5, -3], np.int64)
        f["u"] = np.array([2 ** 63 + 3, 9], np.uint64)
    with h5py.File(b, "w") as f:
        f["i"] = np.array([2 ** 62, 5, -3], np.int64)
        f["u"] = np.array([2 ** 63, 9], np.uint64)
    rows = {r["name"]: r for r in
            json.loads(inspect_checkpoint(a, diff=b, as_json=True))["diff"]["datasets"]}
    assert rows["/i"]["max_abs_diff"] == 1.0 and rows["/u"]["max_abs_diff"] == 3.0, rows
    want = 1 / np.linalg.norm([2.0 ** 62, 5, 3])
    assert rows["/i"]["rel_l2_diff"] == pytest.approx(want, rel=1e-12), rows


def test_inspect_diff_of_nan_in_the_same_places_is_no_difference(tmp_path):
    """A diverged run's checkpoint (NaN and inf in its weights) against an
    identical copy: ``inspect --diff`` said max_abs_diff nan (NaN - NaN,
    inf - inf), as if they differed. Now a NaN or an infinity in the same
    place of both is no difference (NumPy's array_equal with equal_nan); a
    NaN on one side only still shows as nan."""
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    w = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    near = np.array([3.0, np.nan, 4.0, np.inf], np.float32)
    with h5py.File(a, "w") as f:
        f["same"], f["other"], f["near"] = w, w, near
    with h5py.File(b, "w") as f:
        f["same"], f["other"] = w, np.where(np.isnan(w), 0, w)
        f["near"] = np.array([3.0, np.nan, 4.5, np.inf], np.float32)
    rows = {r["name"]: r for r in
            json.loads(inspect_checkpoint(a, diff=b, as_json=True))["diff"]["datasets"]}
    assert np.array_equal(w, w, equal_nan=True)
    assert rows["/same"] == {"name": "/same", "max_abs_diff": 0.0, "rel_l2_diff": 0.0,
                             "unread_fill": 0, "equal": True, "status": "equal"}, rows
    # the shared NaN and inf are left out of the norms too: 0.5 / ||(3, 4.5)||
    assert rows["/near"]["max_abs_diff"] == 0.5, rows
    assert rows["/near"]["rel_l2_diff"] == pytest.approx(0.5 / np.hypot(3, 4.5)), rows
    assert rows["/other"]["max_abs_diff"] == "nan", rows
    assert [rows[n]["status"] for n in ("/near", "/other")] == ["differs", "differs"], rows


def _diff_reference(x, y):
    """max |x - y| and ||x - y|| / max(||x||, ||y||) in NumPy, a NaN or an
    infinity in the same place of both no difference, left out of the norms."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    both = (np.isnan(x) & np.isnan(y)) | (np.isinf(x) & (x == y))
    with np.errstate(invalid="ignore"):
        d = np.where(both, 0.0, x - y)
    with np.errstate(invalid="ignore"):
        norm = max(np.linalg.norm(x[~both]), np.linalg.norm(y[~both]))
        dd = np.linalg.norm(d)
        return float(np.max(np.abs(d))), 0.0 if dd == 0 else float(dd / norm)


def test_inspect_diff_of_chunks_neither_file_wrote(tmp_path, monkeypatch):
    """Chunked datasets with a NaN fill value whose unwritten chunks
    differ: over BLOCK_BYTES only the chunks either file wrote are read,
    and the chunks neither wrote were compared as NaN - NaN, so
    ``inspect --diff`` said max_abs_diff nan for files whose every value
    reads alike. Now those are compared as the fill values (NaN and NaN,
    inf and inf equal), as the whole read compares them, the row says how
    many (``unread_fill``), and the figures are NumPy's on the whole
    arrays, read chunk by chunk or whole."""
    import purine_mpi.tools.inspect as inspect_mod
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    w = np.arange(80, dtype=np.float32).reshape(8, 10)  # one chunk
    for path, fills, writes in ((a, (np.nan, np.inf, np.nan, 0.0), ((0, w), (1, w + 1))),
                                (b, (np.nan, np.inf, 0.0, 0.0), ((0, w), (1, w)))):
        with h5py.File(path, "w") as f:
            for name, fill in zip(("nan", "inf", "mixed", "zero"), fills):
                d = f.create_dataset(name, shape=(40, 10), chunks=(8, 10), dtype=np.float32,
                                     fillvalue=fill)
                for chunk, value in writes:
                    d[chunk * 8:chunk * 8 + 8] = value
            if path == b:  # "zero": chunk 2 in the second file only
                d[16:24] = 5.0
            d = f.create_dataset("same", shape=(40, 10), chunks=(8, 10), dtype=np.float32,
                                 fillvalue=np.nan)
            d[0:8] = w
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        want = {"/" + n: _diff_reference(fa[n][...], fb[n][...]) for n in fa}
    assert want["/same"] == (0.0, 0.0) and want["/nan"][0] == want["/inf"][0] == 1.0
    assert want["/zero"][0] == 5.0
    assert np.isnan(want["/mixed"][0])  # NaN on one side only: a difference
    # chunk by chunk (320-byte chunks), and whole: chunks 2 to 4 neither file
    # wrote, of "zero" 3 and 4, of "same" 1 to 4 (80 values a chunk)
    unread = {"/nan": 240, "/inf": 240, "/mixed": 240, "/zero": 160, "/same": 320}
    for block in (400, 64 << 20):
        monkeypatch.setattr(inspect_mod, "BLOCK_BYTES", block)
        rows = {r["name"]: r for r in
                json.loads(inspect_checkpoint(a, diff=b, as_json=True))["diff"]["datasets"]}
        for name, (biggest, rel) in want.items():
            row = rows[name]
            if np.isnan(biggest):
                assert row["max_abs_diff"] == "nan", (block, row)
            else:
                assert row["max_abs_diff"] == biggest, (block, row)
                assert row["rel_l2_diff"] == pytest.approx(rel, rel=1e-12), (block, row)
            assert row["unread_fill"] == (unread[name] if block == 400 else 0), (block, row)
    monkeypatch.setattr(inspect_mod, "BLOCK_BYTES", 400)  # the text says so
    assert "(320 values written by neither file, compared as their fill values)" in \
        inspect_checkpoint(a, diff=b)


def test_inspect_counts_nan_and_inf(tmp_path, monkeypatch):
    """One NaN in a weight made every figure of ``inspect`` nan, with no
    word on how many values are: one or all. Now each dataset says its NaN
    and infinite counts (NumPy's isnan / isinf), read whole or chunk by
    chunk (never-written chunks counted as their fill value)."""
    import purine_mpi.tools.inspect as inspect_mod
    path = str(tmp_path / "n.h5")
    w = np.arange(60, dtype=np.float32).reshape(6, 10)
    w[1, 2] = w[4, 4] = np.nan
    w[5, 0] = -np.inf
    with h5py.File(path, "w") as f:
        f["w"] = w
        d = f.create_dataset("c", shape=(40, 10), chunks=(4, 10), dtype=np.float32,
                             fillvalue=np.nan)
        d[0:8] = w[:4].repeat(2, axis=0)
    whole = np.full((40, 10), np.nan, np.float32)
    whole[0:8] = w[:4].repeat(2, axis=0)
    for block in (64 << 20, 200):  # whole, and chunk by chunk
        monkeypatch.setattr(inspect_mod, "BLOCK_BYTES", block)
        got = {d["name"]: d for d in json.loads(inspect_checkpoint(path, as_json=True))["datasets"]}
        for name, ref in (("/w", w), ("/c", whole)):
            assert (got[name]["nan"], got[name]["inf"]) == \
                (int(np.isnan(ref).sum()), int(np.isinf(ref).sum())), (block, got[name])
    assert "(2 nan, 1 inf of 60)" in inspect_checkpoint(path)


def test_inspect_min_max_of_integers_are_exact(tmp_path, monkeypatch):
    """``inspect`` took min and max in float64: an int64 of 2**62 + 1 was
    reported as 4611686018427387904 (2**62), a uint64 of 2**64 - 1 as
    2**64. Now an integer dataset's min and max are NumPy's exact integers,
    whole or chunk by chunk."""
    import purine_mpi.tools.inspect as inspect_mod
    path = str(tmp_path / "i.h5")
    i = np.array([2 ** 62 + 1, -(2 ** 62) - 3, 7] * 10, np.int64)
    u = np.array([2 ** 64 - 1, 2 ** 63 + 1] * 10, np.uint64)
    with h5py.File(path, "w") as f:
        f["i"] = i
        f.create_dataset("u", data=u, chunks=(4,))
    for block in (64 << 20, 64):
        monkeypatch.setattr(inspect_mod, "BLOCK_BYTES", block)
        got = {d["name"]: d for d in json.loads(inspect_checkpoint(path, as_json=True))["datasets"]}
        assert (got["/i"]["min"], got["/i"]["max"]) == (int(i.min()), int(i.max())), got["/i"]
        assert (got["/u"]["min"], got["/u"]["max"]) == (int(u.min()), int(u.max())), got["/u"]
    assert str(2 ** 64 - 1) in inspect_checkpoint(path)
