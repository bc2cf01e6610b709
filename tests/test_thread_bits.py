"""Same config, seed and data: the same bits at any thread count
(docs/running.md, "Reproducibility"). OpenBLAS's threaded GEMM gave other
bits with 2 threads than with 1; BLAS now runs one thread and the host
products (purine_mpi/ops/hostgemm.py) cut each product by its shapes only.

- every op's forward and backward at PURINE_THREADS=1, 2 and 3, bitwise
  (benchmarks/thread_bits.py, one process per count);
- a digits LeNet trained at 1 and 2 threads: bitwise equal checkpoints;
- ``hostgemm.matmul`` itself: the same bits for 1, 2, 3 and 5 threads on
  every way it cuts a product, close to the float64 product, the cuts a
  function of the shapes, concurrent callers, errors raised;
- the exported BLAS variables."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from purine_mpi.ops import hostgemm
from tests.conftest import PYTHON, REPO, checkpoint_arrays, cli_env

BLAS_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def threads_env(n):
    env = cli_env()
    for var in BLAS_VARS:
        env.pop(var, None)  # the suite's own limit off: PURINE_THREADS alone decides
    env["PURINE_THREADS"] = str(n)
    return env


@pytest.mark.slow
def test_every_op_gives_the_same_bits_at_1_2_and_3_threads():
    res = subprocess.run([PYTHON, os.path.join(REPO, "benchmarks", "thread_bits.py"),
                          "--threads", "1", "2", "3"], cwd=REPO, env=threads_env(1),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " same" in res.stdout and "differ" not in res.stdout, res.stdout


def test_training_gives_the_same_checkpoint_at_1_and_2_threads(digits_h5, tmp_path):
    """jobs/digits_lenet.yaml, 10 iterations: its conv2 products are cut in
    pieces (and were split differently by OpenBLAS at 2 threads)."""
    ckpts = {}
    for n in (1, 2):
        out = tmp_path / f"t{n}"
        res = subprocess.run(
            [PYTHON, "-m", "purine_mpi", "train", os.path.join(REPO, "jobs", "digits_lenet.yaml"),
             "--iters", "10", "--out", str(out), "--set", f"data.train.path={digits_h5}",
             "--set", f"data.test.path={digits_h5}", "--set", "solver.test_interval=0",
             "--set", "checkpoint.interval=10"],
            cwd=REPO, env=threads_env(n), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"threads     {n} per rank (PURINE_THREADS)" in res.stdout, res.stdout
        ckpts[n] = checkpoint_arrays(out / "ckpt_10.h5")
    assert ckpts[1].keys() == ckpts[2].keys() and any(k.startswith("params/") for k in ckpts[1])
    differ = [k for k in ckpts[1] if not np.array_equal(ckpts[1][k], ckpts[2][k])]
    assert not differ, differ


# ------------------------------------------------------------- hostgemm
RNG = np.random.default_rng(7)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture
def pool_threads():
    """Sets hostgemm.THREADS for a test and puts it back."""
    old = hostgemm.THREADS
    yield lambda n: setattr(hostgemm, "THREADS", n)
    hostgemm.THREADS = old


CASES = [
    ("rows", (640, 300), (300, 40)),              # M >= 96: row pieces
    ("inner", (32, 20000), (20000, 75)),          # short and wide: K pieces, summed
    ("columns", (40, 200), (200, 2000)),          # short, N > K: column pieces
    ("one call", (30, 40), (40, 50)),              # too small to cut
    ("batched", (1, 32, 800), (9, 1, 800, 64)),    # conv forward: w against each sample
    ("batch of 1", (1, 2, 300, 200), (2, 200, 120)),
    # a batch of one whose matrix is cut along K: the pieces add into out[0]
    # (AlexNet-style conv1 weight gradient under micro-batches)
    ("batch of 1, inner", (1, 32, 20000), (1, 20000, 75)),
    ("transposed view", (2000, 640), (2000, 48)),  # a.T @ b: fc's weight gradient
    # cifar10_quick's products (benchmarks/hostgemm_cost.py): conv2's forward
    # rows (w a transposed view), its weight gradient (K in 2 pieces), conv1's
    # forward at one thread one NumPy call, fc2 below the split size
    ("cifar rows", (1280, 800), (32, 800)),
    ("cifar inner", (32, 1280), (1280, 800)),
    ("cifar batched", (1, 32, 75), (13, 1, 75, 1024)),
    ("cifar one call", (100, 64), (64, 10)),
]


@pytest.mark.parametrize("name,sa,sb", CASES, ids=[c[0] for c in CASES])
def test_matmul_has_the_same_bits_at_any_thread_count(pool_threads, name, sa, sb):
    a, b = randn(*sa), randn(*sb)
    if name == "transposed view":
        a = a.T
    if name == "cifar rows":
        b = b.T
    results = []
    for n in (1, 2, 3, 5):
        pool_threads(n)
        results.append(hostgemm.matmul(np, a, b))
        out = np.full_like(results[0], np.nan)
        assert hostgemm.matmul(np, a, b, out=out) is out
        assert np.array_equal(out, results[-1])
    for r in results[1:]:
        assert np.array_equal(results[0], r)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert results[0].shape == want.shape
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-3 * np.sqrt(a.shape[-1]))


def test_the_cuts_follow_the_shapes():
    for m, n, k in [(640, 40, 300), (32, 75, 20000), (40, 2000, 200), (30, 50, 40),
                    (100000, 3, 7), (97, 97, 97), (4096, 4096, 4096)]:
        axis, cuts = hostgemm.plan(m, n, k)
        size = (m, n, k)[axis]
        assert cuts[0].start == 0 and cuts[-1].stop == size
        assert all(x.stop == y.start for x, y in zip(cuts, cuts[1:]))
        assert len(cuts) <= hostgemm.MAX_PIECES
        assert all((c.stop - c.start) % hostgemm.ALIGN == 0 for c in cuts[:-1])
        if m * n * k < hostgemm.SPLIT_MIN_WORK:
            assert cuts == [slice(0, m)]
    assert hostgemm.plan(640, 40, 300)[0] == 0
    assert hostgemm.plan(32, 75, 20000)[0] == 2
    assert hostgemm.plan(40, 2000, 200)[0] == 1
    assert len(hostgemm.plan(30, 50, 40)[1]) == 1


@pytest.mark.parametrize("sa,sb", [((32, 1280), (1280, 800)), ((32, 20000), (20000, 75))])
def test_a_cut_along_k_adds_its_pieces_in_order_into_out(pool_threads, sa, sb):
    """The pieces' products add into out in their order, whatever the thread
    count and out's layout (a transposed view BLAS cannot write goes through
    scratch); one thread keeps one scratch matrix, not one per piece."""
    a, b = randn(*sa), randn(*sb)
    axis, cuts = hostgemm.plan(sa[0], sb[1], sa[1])
    assert axis == 2 and len(cuts) >= 2
    want = np.matmul(a[:, cuts[0]], b[cuts[0]])
    for s in cuts[1:]:
        want += np.matmul(a[:, s], b[s])
    for n in (1, 2, 3):
        pool_threads(n)
        hostgemm._LOCAL.flat = {}  # this thread's scratch, to see what the product takes
        assert np.array_equal(hostgemm.matmul(np, a, b), want)
        if n == 1:
            assert hostgemm._LOCAL.flat["<f4"].size == want.size
        for out in (np.full_like(want, np.nan), np.full(want.shape[::-1], np.nan, np.float32).T):
            assert hostgemm.matmul(np, a, b, out=out) is out
            assert np.array_equal(out, want)


def test_a_product_below_the_split_size_is_one_call_without_a_plan(monkeypatch):
    a, b = randn(100, 64), randn(64, 10)
    monkeypatch.setattr(hostgemm, "plan", None)  # not consulted
    assert np.array_equal(hostgemm.matmul(np, a, b), np.matmul(a, b))


def test_concurrent_callers_each_get_their_product(pool_threads):
    """The dispatcher's lanes call matmul at once: the pool is shared, every
    product is right and has its one-caller bits."""
    pool_threads(2)
    pairs = [(randn(400, 300), randn(300, 200)), (randn(32, 30000), randn(30000, 80)),
             (randn(1, 16, 500), randn(6, 1, 500, 90))]
    alone = [hostgemm.matmul(np, a, b) for a, b in pairs]
    got = {}

    def lane(i):
        for _ in range(5):
            got[i] = hostgemm.matmul(np, *pairs[i])
            assert np.array_equal(got[i], alone[i])

    lanes = [threading.Thread(target=lane, args=(i,)) for i in range(len(pairs))]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in lanes)
    assert all(np.array_equal(got[i], alone[i]) for i in range(len(pairs)))


def test_an_error_in_a_piece_is_raised(pool_threads):
    pool_threads(2)
    a, b = randn(640, 300), randn(300, 40)
    want = hostgemm.matmul(np, a, b)
    with pytest.raises(TypeError):
        hostgemm.matmul(np, a, b, out=np.empty((640, 40), np.int32))
    assert np.array_equal(hostgemm.matmul(np, a, b), want)  # the pool still works


def test_vectors_go_to_numpy():
    a, b = randn(300), randn(300, 7)
    assert np.array_equal(hostgemm.matmul(np, a, b), np.matmul(a, b))
    assert np.array_equal(hostgemm.matmul(np, b.T, a), np.matmul(b.T, a))


# ------------------------------------------------------------- the BLAS variables
PROBE = ("import purine_mpi.base.threads as t, os; "
         "print('DECIDED', t.DECISION[0], os.environ['OPENBLAS_NUM_THREADS'], "
         "os.environ['MKL_NUM_THREADS'], os.environ['OMP_NUM_THREADS']); print(t.DECISION[1])")


def test_blas_runs_one_thread_and_the_rank_keeps_its_count(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], env=threads_env(2), cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert "DECIDED 2 1 1 2" in out.stdout, out.stdout + out.stderr


def test_a_users_blas_thread_count_is_named(tmp_path):
    env = threads_env(2)
    env["OPENBLAS_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert "DECIDED 2 2 1 2" in out.stdout, out.stdout + out.stderr
    assert "OPENBLAS_NUM_THREADS=2 set: BLAS's own threads make the results depend on " \
           "the thread count" in out.stdout, out.stdout
