"""``data cifar10 --download``: the archive is fetched, its MD5 verified, it
is unpacked and converted. Served here from a small fake archive of the
official layout on a local HTTP server (127.0.0.1): nothing leaves the
machine. And a missing data file's hint names the command for its data set."""
import functools
import hashlib
import http.server
import io
import pickle
import tarfile
import threading

import h5py
import numpy as np
import pytest

from purine_mpi.job.data_spec import data_hint
from tests.conftest import cli_env, run_cli_args, run_cli_here


def _batch(n, seed):
    rng = np.random.default_rng(seed)
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, n)]}


def _archive(path, n=6):
    """cifar-10-python.tar.gz's layout: cifar-10-batches-py/data_batch_1..5, test_batch."""
    with tarfile.open(path, "w:gz") as tar:
        for k, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
            blob = pickle.dumps(_batch(n, k), protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    md5 = _archive(root / "cifar-10-python.tar.gz")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/cifar-10-python.tar.gz", md5, httpd
    httpd.shutdown()
    httpd.server_close()


def _run(tmp_path, url, md5, *extra):
    import os
    env_backup = dict(os.environ)
    os.environ.update(PURINE_CIFAR10_URL=url, PURINE_CIFAR10_MD5=md5)
    try:
        return run_cli_args("data", "cifar10", "--download", "--out", tmp_path / "c.h5", *extra)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)


def test_download_verifies_unpacks_and_converts(tmp_path, server):
    url, md5, httpd = server
    res = _run(tmp_path, url, md5)
    assert res.returncode == 0, res.stderr
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert f["train/data"].shape == (30, 3, 32, 32) and f["test/data"].shape == (6, 3, 32, 32)
        want = _batch(6, 0)[b"data"].reshape(-1, 3, 32, 32)
        np.testing.assert_array_equal(f["train/data"][:6], want)
    # a second run reuses the verified archive: the server may be gone
    httpd.shutdown()
    res = _run(tmp_path, url, md5)
    assert res.returncode == 0 and "already downloaded" in res.stderr, res.stderr


def test_a_wrong_checksum_keeps_nothing_and_exits_2(tmp_path, server):
    url, md5, _ = server
    res = _run(tmp_path, url, "0" * 32)
    assert res.returncode == 2 and "MD5" in res.stderr and "Traceback" not in res.stderr
    folder = tmp_path / "cifar-10-download"
    # nothing kept, not even the folder the download made (issue 36, case 7)
    assert not folder.exists() and not (tmp_path / "c.h5").exists()


def test_an_unreachable_server_is_one_message(tmp_path, server):
    url, md5, httpd = server
    httpd.shutdown()
    httpd.server_close()
    res = _run(tmp_path, url, md5)
    assert res.returncode == 2 and "could not download" in res.stderr, res.stderr


def test_missing_data_files_name_the_command_of_their_data_set():
    assert "data cifar10 --download --out data/cifar10.h5" in data_hint("data/cifar10.h5")
    assert "data digits --out data/digits.h5" in data_hint("data/digits.h5")
    assert "docs/formats.md" in data_hint("mine.h5")


def test_the_cifar_job_without_its_file_says_how_to_make_it(tmp_path):
    res = run_cli_here("train", "jobs/cifar10_quick_hdf5.yaml", "--set",
                       f"data.train.path={tmp_path}/cifar10.h5", "--out", tmp_path / "r")
    assert res.returncode == 2 and "data cifar10 --download" in res.stderr, res.stderr


def test_a_missing_from_archive_is_named_as_what_from_takes(tmp_path):
    """--from names a file that is not there: the message names the path as a
    source (not a "directory": an archive is what the README gives) and what
    --from takes, without asking to unpack the archive (data cifar10 does)."""
    res = run_cli_args("data", "cifar10", "--from", tmp_path / "cifar-10-python.tar.gz",
                       "--out", tmp_path / "c.h5")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "cifar-10-python.tar.gz' not found" in res.stderr, res.stderr
    assert "directory" not in res.stderr and "unpack" not in res.stderr.replace(
        "the unpacked", ""), res.stderr
    assert "--download" in res.stderr and not (tmp_path / "c.h5").exists()
