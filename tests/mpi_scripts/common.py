"""Shared pieces of the MPI test programs: small configs and a graph runner.

Each program checks its own closed-form expectations on every rank and ends
with ``ok(name)`` (prints "OK <name> rank R"); any failure raises, and the
abort handler ends the whole job non-zero."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import purine_mpi.comm.ops  # noqa: E402,F401  (registers Allreduce/Send/Recv)
from purine_mpi.comm.world import get_world, install_abort_handler  # noqa: E402
from purine_mpi.job.config import resolve_job  # noqa: E402
from purine_mpi.layers.fillers import fill  # noqa: E402
from purine_mpi.runtime.factory import make_dispatcher  # noqa: E402


def world():
    w = get_world()
    install_abort_handler(w)
    return w


def emulated_gpu_rank(build_root):
    """This rank on the emulated GPU (tests/emulated_gpu) as a trainer runs
    it: host staging of device buffers (the mpich wheel is not CUDA-aware),
    the kernels compiled under ``build_root`` (one folder for every rank
    and launch: tests/emulated_gpu/host_kernels.py builds each kernel
    once, under a lock). Returns (the world,
    the pytest MonkeyPatch holding the emulated CuPy for this process)."""
    import pathlib

    import pytest

    from purine_mpi.comm import device as comm_device
    from tests import emulated_gpu as emu
    os.environ["PURINE_MPI_CUDA_AWARE"] = "0"
    comm_device.cuda_aware.cache_clear()
    w = world()
    build = pathlib.Path(build_root)  # shared by the ranks: each kernel built once
    build.mkdir(parents=True, exist_ok=True)
    patch = pytest.MonkeyPatch()
    emu.emulated_trainer_env(patch, build)
    return w, patch


def ok(name):
    w = get_world()
    print(f"OK {name} rank {w.rank}", flush=True)


def mlp_config(batch=4, hidden=(6, 5), classes=3, shape=(1, 2, 4), solver=None, parallel=None,
               seed=3, frozen=()):
    """The job of a small MLP on synthetic data (fc/relu layers, softmax
    loss); the fc layers named in ``frozen`` at ``lr_mult: 0``."""
    net, bottom = [], "data"
    for i, h in enumerate(hidden):
        net.append({"type": "fc", "name": f"fc{i + 1}", "bottom": bottom, "top": f"fc{i + 1}",
                    "num_output": h})
        if f"fc{i + 1}" in frozen:
            net[-1]["param"] = [{"lr_mult": 0}, {"lr_mult": 0}]
        net.append({"type": "relu", "name": f"relu{i + 1}", "bottom": f"fc{i + 1}",
                    "top": f"fc{i + 1}"})
        bottom = f"fc{i + 1}"
    net.append({"type": "fc", "name": "out", "bottom": bottom, "top": "out",
                "num_output": classes})
    net.append({"type": "softmax_loss", "name": "loss", "bottom": ["out", "label"],
                "top": "loss"})
    raw = {"name": "mlp", "seed": seed,
           "data": {"train": {"source": "synthetic", "shape": list(shape), "classes": classes,
                              "num_samples": 96, "batch_size": batch, "shuffle": True}},
           "net": net,
           "solver": dict({"base_lr": 0.1, "momentum": 0.9, "weight_decay": 0.001,
                           "lr_policy": "step", "gamma": 0.5, "stepsize": 2, "max_iter": 4,
                           "test_interval": 0, "display": 0}, **(solver or {})),
           "parallel": dict({"scheme": "data", "mode": "sync"}, **(parallel or {}))}
    return resolve_job(raw, "<test>", check_files=False)


def init_params(graph, workspace, seed):
    for b in graph.blobs.values():
        if b.kind == "param" and b.alias_of is None:
            workspace.set(b.name, fill(b, seed))


def run(graph, iters, seed=3, kind="event", start=0, stall_timeout=60.0, init=True,
        rank=0, defer=False, deferred=None):
    """Run ``graph`` for ``iters`` iterations; returns the dispatcher (its
    workspace holds the results). Params are initialised from their fillers.
    ``defer``: with the deferred tail (parallel.defer_update), drained at the
    end; ``deferred``, a list, gets for each iteration how many tail ops
    were still unfinished when its run returned."""
    d = make_dispatcher(graph, kind, rank=rank, stall_timeout=stall_timeout, seed=seed,
                        defer_tail=defer)
    if init:
        init_params(graph, d.workspace, seed)
    for it in range(start, start + iters):
        if "iter" in d.workspace.arrays:
            d.workspace["iter"][...] = it
        d.run(it)
        if deferred is not None:
            deferred.append(len(d.schedule.tail_todo))
    d.drain()
    return d


def assert_close(a, b, what, rtol=1e-5, atol=1e-6):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=atol):
        diff = np.max(np.abs(a - b)) if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: mismatch (max abs diff {diff})\n{a}\n{b}")


def assert_like_one_rank(w, mine, reference, params, rtol, atol):
    """Data parallelism's equivalence: this rank's parameters ``mine`` equal
    one rank's (``reference``, with the whole global batch) within
    tolerance, and every rank holds bitwise the same values."""
    for p in params:
        assert_close(mine[p], reference[p], p, rtol=rtol, atol=atol)
    for other in w.comm.allgather(mine):
        for p in params:
            assert np.array_equal(other[p], mine[p]), f"{p} differs between ranks"


def assert_like_one_rank_with_batch(w, mine, params, batch, iters, rtol=2e-5, atol=2e-6):
    """``mine`` (this rank's parameters after ``iters`` iterations) equal one
    CPU rank's training of mlp_config with ``batch`` (the ranks' total)."""
    from purine_mpi.job.replica import build_train_graph
    ref_graph, _ = build_train_graph(mlp_config(batch=batch), 0, 1)
    ref = run(ref_graph, iters)
    assert_like_one_rank(w, mine, ref.workspace, params, rtol=rtol, atol=atol)
    ref.close()


def datasets(group, prefix=""):
    """(path, dataset) under an h5py ``group`` in the file's order (creation
    order: the checkpoint's groups are written with track_order)."""
    import h5py
    for name in group:
        if isinstance(group[name], h5py.Group):
            yield from datasets(group[name], f"{prefix}{name}/")
        else:
            yield f"{prefix}{name}", group[name]


def check_dataset(path, section, key, dset, value):
    """Dataset ``key`` of ``section`` in checkpoint ``path`` holds ``value``
    bit for bit, with its Fletcher-32 checksum."""
    assert dset.fletcher32 and dset.dtype == value.dtype, (path, key)
    assert dset.shape == value.shape, (path, key)
    assert dset[()].tobytes() == value.tobytes(), (path, section, key)
