"""The lmdb data source (Caffe's Datum records) and the mean_file transform:
records read as Caffe lays them out (raw, PNG, float_data), the same batches
as an HDF5 file of the same samples (order, shuffle, shards, transform), the
mean image applied as Caffe's DataTransformer does, and bad databases and
mean files as exit-2 errors naming the source and the key."""
import json
import sys

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import ConfigError, UserError
from purine_mpi.job.config import resolve_config
from purine_mpi.data.sources import check_labels, make_source, source_info
from purine_mpi.data.protowire import read_datum, write_datum
from purine_mpi.data.transform import apply_transform, output_shape

from .conftest import run_cli_args, run_cli_here
from .lmdb_fixtures import put, write_lmdb, write_mean
from .test_cli import assert_user_error
from .test_transform import read

N, C, H, W = 20, 3, 7, 6


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(8)
    return rng.integers(0, 256, (N, C, H, W), dtype=np.uint8), rng.integers(0, 5, N)


@pytest.fixture(scope="module")
def same_data(images, tmp_path_factory):
    """The same samples as a raw LMDB, a PNG LMDB and an HDF5 file (uint8)."""
    x, y = images
    root = tmp_path_factory.mktemp("lmdb")
    h5 = str(root / "same.h5")
    with h5py.File(h5, "w") as f:
        f["train/data"], f["train/label"] = x, y
    return {"raw": write_lmdb(root / "raw_lmdb", x, y),
            "png": write_lmdb(root / "png_lmdb", x, y, "png", names=True), "h5": h5}


def test_datum_round_trip_as_caffe_encodes_it():
    buf = write_datum(2, 1, 3, bytes(range(6)), label=-1, float_data=[0.5, 2.0])
    d = read_datum(buf)
    assert (d["channels"], d["height"], d["width"], d["label"]) == (2, 1, 3, -1)
    assert bytes(d["data"]) == bytes(range(6)) and d["float_data"].tolist() == [0.5, 2.0]
    # the bytes Caffe's protobuf writes for Datum{channels:1 height:1 width:2 data:"\x07\x09" label:3}
    assert write_datum(1, 1, 2, b"\x07\x09", 3) == bytes.fromhex("080110011802220207092803")


@pytest.mark.parametrize("encoding", ["raw", "png"])
def test_records_read_back_in_key_order(same_data, images, encoding):
    x, y = images
    src = make_source({"source": "lmdb", "path": same_data[encoding]})
    assert (src.n_samples, src.sample_shape) == (N, (C, H, W))
    assert source_info({"source": "lmdb", "path": same_data[encoding]}) == (N, (C, H, W))
    data, labels = src.gather([5, 0, 5, N - 1])
    assert data.dtype == np.uint8  # the transform converts, as for a uint8 HDF5 file
    np.testing.assert_array_equal(data, x[[5, 0, 5, N - 1]])  # PNG: BGR back, as OpenCV
    np.testing.assert_array_equal(labels, y[[5, 0, 5, N - 1]])


def test_float_data_and_grey_png(tmp_path):
    rng = np.random.default_rng(1)
    floats = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    src = make_source({"source": "lmdb", "path": write_lmdb(tmp_path / "f", floats, range(4),
                                                              "float")})
    data, labels = src.gather([3, 1])
    assert data.dtype == np.float32 and np.array_equal(data, floats[[3, 1]])
    grey = rng.integers(0, 256, (3, 1, 5, 4), dtype=np.uint8)
    src = make_source({"source": "lmdb", "path": write_lmdb(tmp_path / "g", grey, [1, 2, 3],
                                                              "png")})
    assert src.sample_shape == (1, 5, 4) and np.array_equal(src.gather([2])[0], grey[[2]])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("encoding", ["raw", "png"])
def test_batches_equal_the_hdf5_source_of_the_same_samples(same_data, images, tmp_path,
                                                           encoding, world):
    """Shuffled over 3 epochs, sharded over ``world`` ranks, with crop,
    mirror, a mean image and scale: every batch equals the HDF5 source's."""
    x, _ = images
    mean = write_mean(tmp_path / "mean.binaryproto", x.mean(axis=0))
    transform = {"crop_size": 5, "mirror": True, "mean_file": mean, "scale": 0.02,
                 "shuffle": True}
    h5_spec = dict({"source": "hdf5", "path": same_data["h5"], "split": "train"}, **transform)
    db_spec = dict({"source": "lmdb", "path": same_data[encoding]}, **transform)
    for train in (True, False):
        for r in range(world):
            got = read(db_spec, 3, 14, r, world, train=train)
            want = read(h5_spec, 3, 14, r, world, train=train)
            for (a, la), (b, lb) in zip(got, want):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(la, lb)


def caffe_transform(sample, mean_image, scale, crop, top, left, flip):
    """Caffe's DataTransformer::Transform(Datum) loop for one sample with a
    mean file: top_index flips w, data_index (and the mean's) does not."""
    out = np.empty((C, crop, crop), np.float64)
    for c in range(C):
        for h in range(crop):
            for w in range(crop):
                top_w = crop - 1 - w if flip else w
                src = (c, top + h, left + w)
                out[c, h, top_w] = (float(sample[src]) - float(mean_image[src])) * scale
    return out.astype(np.float32)


def test_mean_file_is_subtracted_as_caffe_does(images, tmp_path):
    x, _ = images
    mean_image = np.random.default_rng(2).uniform(0, 255, (C, H, W)).astype(np.float32)
    spec = {"mean_file": write_mean(tmp_path / "m.binaryproto", mean_image), "scale": 0.5,
            "crop_size": 4, "mirror": True}
    positions = np.arange(40, 40 + N)
    out = apply_transform(x, spec, positions, 9, True)
    flips = set()
    for i in range(N):
        hits = [(t, lf, f) for t in range(H - 3) for lf in range(W - 3) for f in (0, 1)
                if np.allclose(out[i], caffe_transform(x[i], mean_image, 0.5, 4, t, lf, f),
                               atol=1e-4)]
        assert hits, f"sample {i} is no Caffe transform of its image"
        flips.add(hits[0][2])
    assert flips == {0, 1}
    centre = apply_transform(x, spec, positions, 9, False)
    for i in range(N):
        np.testing.assert_allclose(centre[i], caffe_transform(
            x[i], mean_image, 0.5, 4, (H - 4) // 2, (W - 4) // 2, False), atol=1e-4)


# ------------------------------------------------------------------ errors
def test_bad_databases_name_the_source_and_the_key(images, tmp_path):
    x, y = images

    def fails(path, *needles):
        with pytest.raises(UserError) as info:
            make_source({"source": "lmdb", "path": str(path)}).gather(np.arange(N))
        for needle in needles:
            assert needle in str(info.value), str(info.value)

    fails(tmp_path / "nowhere", "lmdb source", "nowhere", "not found")
    (tmp_path / "plain").mkdir()
    fails(tmp_path / "plain", "without data.mdb")
    empty = write_lmdb(tmp_path / "empty", x[:0], y[:0])
    fails(empty, f"lmdb source '{empty}' is empty")
    mixed = write_lmdb(tmp_path / "mixed", x, y)
    put(mixed, b"%08d" % 7, write_datum(C, H - 1, W, bytes(C * (H - 1) * W), 1))
    fails(mixed, f"lmdb source '{mixed}'", "record '00000007' has shape [3, 6, 6]",
          "first record '00000000' has [3, 7, 6]")
    junk = write_lmdb(tmp_path / "junk", x, y)
    put(junk, b"%08d" % 3, b"\xff\xff\xff")
    fails(junk, "record '00000003' is not a Caffe Datum")
    short = write_lmdb(tmp_path / "short", x, y)
    put(short, b"%08d" % 4, write_datum(C, H, W, bytes(10), 1))
    fails(short, "record '00000004' holds 10 bytes for channels x height x width = 3 x 7 x 6")
    png = write_lmdb(tmp_path / "badpng", x, y)
    put(png, b"%08d" % 2, write_datum(0, 0, 0, b"not a png", 1, encoded=True))
    fails(png, "record '00000002' is marked encoded but Pillow cannot decode it")


def test_labels_are_checked_against_the_classes(images, same_data):
    check_labels({"source": "lmdb", "path": same_data["raw"]}, 5, layer="loss")
    first = int(np.argmax(images[1] == 4))
    with pytest.raises(UserError, match=rf"lmdb source '.*raw_lmdb': record '{first:08d}' holds "
                                        rf"label 4 \(sample {first}; \d+ bad in all\), outside "
                                        r"\[0, 4\)"):
        check_labels({"source": "lmdb", "path": same_data["raw"]}, 4, layer="loss")


def test_a_missing_lmdb_package_says_how_to_install_it(same_data, monkeypatch):
    from purine_mpi.data import filecache, lmdb_source
    monkeypatch.setitem(sys.modules, "lmdb", None)
    monkeypatch.setattr(filecache, "_CACHE", {})  # the database is read again
    monkeypatch.setattr(lmdb_source, "_ENVS", {})
    with pytest.raises(UserError, match=r"needs the 'lmdb' package.*pip install "
                                        r"'purine_mpi\[caffe\]'"):
        source_info({"source": "lmdb", "path": same_data["raw"]})


def test_mean_file_errors(images, same_data, tmp_path):
    x, _ = images
    spec = {"source": "lmdb", "path": same_data["raw"], "batch_size": 2}
    bad = tmp_path / "bad.binaryproto"
    bad.write_bytes(b"\x0a\x05abc")
    with pytest.raises(ConfigError, match=r"data.train.mean_file.*not a Caffe BlobProto"):
        resolve_config({"data": {"train": dict(spec, mean_file=str(bad))}, "net": []}, "<t>")
    with pytest.raises(ConfigError, match=r"data.train.mean_file.*not found"):
        resolve_config({"data": {"train": dict(spec, mean_file=str(tmp_path / "no"))},
                        "net": []}, "<t>")
    with pytest.raises(ConfigError, match="give mean_file or mean, not both"):
        resolve_config({"data": {"train": dict(spec, mean_file=str(bad), mean=1)},
                        "net": []}, "<t>")
    small = write_mean(tmp_path / "small.binaryproto", x[0, :, :5])
    with pytest.raises(UserError, match=r"mean image of shape \[3, 5, 6\] but the samples of "
                                        r"lmdb source '.*raw_lmdb' have shape \[3, 7, 6\]"):
        output_shape({"source": "lmdb", "path": same_data["raw"], "mean_file": small},
                     (C, H, W))


def test_train_on_a_bad_lmdb_exits_2_naming_it(images, tmp_path):
    x, y = images
    mixed = write_lmdb(tmp_path / "mixed_lmdb", x, y)
    put(mixed, b"%08d" % (N - 1), write_datum(C, H, W + 1, bytes(C * H * (W + 1)), 1))
    job = tmp_path / "job.yaml"
    job.write_text(f"data:\n  train: {{source: lmdb, path: {mixed}, batch_size: 4}}\n"
                   "net:\n  - {type: fc, name: fc, bottom: data, top: fc, num_output: 5}\n"
                   "  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}\n"
                   "solver: {max_iter: 2}\n")
    res = run_cli_args("train", job, "--out", tmp_path / "run")
    assert_user_error(res, f"lmdb source '{mixed}'", "record '00000019' has shape [3, 7, 7]")


def test_lmdb_to_h5_round_trip(same_data, images, tmp_path):
    x, y = images
    out = tmp_path / "out.h5"
    res = run_cli_here("data", "lmdb-to-h5", "--from", same_data["png"], "--test-from",
                       same_data["raw"], "--out", out)
    assert res.returncode == 0, res.stderr
    with h5py.File(out, "r") as f:
        for split in ("train", "test"):
            assert f[f"{split}/data"].dtype == np.uint8
            np.testing.assert_array_equal(f[f"{split}/data"][...], x)
            np.testing.assert_array_equal(f[f"{split}/label"][...], y)


def _rss_kib(pid):
    """(RssAnon, RssFile) of process ``pid`` in KiB, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["RssAnon"].split()[0]), int(fields["RssFile"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


@pytest.mark.slow
def test_training_from_an_lmdb_larger_than_the_budget_keeps_memory_flat(tmp_path):
    """A 48 MiB LMDB, 12 x the data memory budget given to the run
    (PURINE_DATA_MEMORY_MB=4), trained for two epochs: the process's own
    memory (RssAnon) grows by less than a quarter of the database after the
    first iterations, so records are not kept; the database's pages are the
    kernel's file cache (RssFile). A stand-in for a database larger than
    RAM: the memory a cached record would take is what is measured."""
    import re
    import subprocess
    import threading
    import time
    from .conftest import PYTHON, REPO, cli_env
    n, shape = 4096, (3, 64, 64)
    rng = np.random.default_rng(0)
    db = tmp_path / "big_lmdb"
    import lmdb
    env = lmdb.open(str(db), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for i in range(n):
            image = rng.integers(0, 256, shape, dtype=np.uint8)
            txn.put(b"%08d" % i, write_datum(*shape, image.tobytes(), label=i % 10))
    env.close()
    db_kib = (db / "data.mdb").stat().st_size // 1024
    assert db_kib > 12 * 4 * 1024 * 0.9
    job = tmp_path / "job.yaml"
    job.write_text(f"data:\n  train: {{source: lmdb, path: {db}, batch_size: 128, shuffle: true,"
                   " scale: 0.004}\n"
                   "net:\n  - {type: fc, name: fc, bottom: data, top: fc, num_output: 10}\n"
                   "  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}\n"
                   "solver: {max_iter: 192, base_lr: 0.001, display: 16}\n")
    child_env = dict(cli_env(), PURINE_DATA_MEMORY_MB="4")
    proc = subprocess.Popen([PYTHON, "-m", "purine_mpi", "train", str(job), "--out",
                             str(tmp_path / "run")], cwd=REPO, env=child_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, samples = [], []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), line) for line in proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        rss = _rss_kib(proc.pid)
        if rss:
            samples.append((time.monotonic(), *rss))
        time.sleep(0.02)
    reader.join()
    err = proc.stderr.read()
    assert proc.returncode == 0, err
    # the first display (iteration 16 of 32 per epoch): the graph is built,
    # the keys are read and half an epoch has gone through
    first = next(t for t, line in lines if re.search(r"iter +16/", line))
    early = max(a for t, a, _ in samples if t <= first)
    late = max(a for _, a, _ in samples)
    growth = late - early
    assert any(re.search(r"iter +192/", line) for _, line in lines)  # six epochs read
    print(json.dumps({"db_kib": db_kib, "rss_anon_at_iter16_kib": early,
                      "rss_anon_peak_kib": late, "growth_kib": growth,
                      "rss_file_peak_kib": max(f for _, _, f in samples)}))
    assert growth < db_kib / 4, (growth, db_kib)


@pytest.mark.mpi
def test_two_ranks_train_from_one_lmdb_like_one_rank(same_data, tmp_path):
    """mpiexec -n 2 on an LMDB (each rank opens the database itself and
    reads its shard) gives the weights of one rank with twice the batch."""
    import h5py
    from .conftest import run_mpi_cli
    job = tmp_path / "job.yaml"
    job.write_text(f"seed: 4\ndata:\n  train: {{source: lmdb, path: {same_data['png']}, "
                   "batch_size: 2, shuffle: true, crop_size: 5, mirror: true, scale: 0.01}\n"
                   "net:\n  - {type: fc, name: fc, bottom: data, top: fc, num_output: 5}\n"
                   "  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}\n"
                   "solver: {max_iter: 12, base_lr: 0.05, display: 0}\n")
    res = run_mpi_cli(2, "train", job, "--out", tmp_path / "two")
    assert res.returncode == 0, res.stderr
    res = run_cli_args("train", job, "--out", tmp_path / "one", "--set",
                       "data.train.batch_size=4")
    assert res.returncode == 0, res.stderr
    weights = []
    for run in ("two", "one"):
        with h5py.File(tmp_path / run / "latest.h5", "r") as f:
            weights.append(f["params/fc/weight"][()])
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-5, atol=1e-6)
