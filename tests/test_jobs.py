"""Every shipped job config loads, composes (shape inference through the
whole net) and trains an iteration on synthetic data of its shapes."""
import glob
import os

import numpy as np
import pytest

from purine_mpi.tools.bench import synthetic_config
from purine_mpi.tools.graph import compose_for
from purine_mpi.job.config import load_config
from purine_mpi.train.trainer import Trainer
from tests.conftest import REPO, FakeWorld, make_job

JOBS = sorted(glob.glob(os.path.join(REPO, "jobs", "*.yaml")))


def test_there_are_jobs():
    names = {os.path.basename(j) for j in JOBS}
    assert {"digits_lenet.yaml", "cifar10_quick.yaml", "nin_cifar10.yaml",
            "googlenet.yaml", "digits_pipeline.yaml", "digits_hybrid.yaml", "gpt_tiny.yaml",
            "gpt_small.yaml"} <= names


@pytest.fixture(scope="module")
def cifar_shaped_h5(tmp_path_factory):
    """A small file in the layout ``data cifar10`` writes (the real set is not shipped)."""
    import h5py
    path = tmp_path_factory.mktemp("cifar") / "cifar10.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for split, n in (("train", 64), ("test", 32)):
            f[f"{split}/data"] = rng.standard_normal((n, 3, 32, 32)).astype(np.float32)
            f[f"{split}/label"] = rng.integers(0, 10, n)
    return str(path)


def _with_local_data(job, digits_h5, cifar_h5, text_h5=None):
    """--set overrides pointing the job's HDF5 files at test data."""
    import yaml
    with open(job) as f:
        data = yaml.safe_load(f).get("data", {})
    sets = []
    for split, spec in data.items():
        if spec.get("source") == "hdf5":
            local = digits_h5 if "digits" in spec["path"] else cifar_h5
            sets.append(f"data.{split}.path={local}")
        elif spec.get("source") == "text":
            sets.append(f"data.{split}.path={text_h5}")
    return sets


@pytest.mark.parametrize("job", JOBS, ids=os.path.basename)
def test_job_composes(job, digits_h5, cifar_shaped_h5, email_h5):
    """(email_h5: the token file the GPT jobs' headers make, conftest.)"""
    cfg = load_config(job, overrides=_with_local_data(job, digits_h5, cifar_shaped_h5, email_h5))
    ranks = {"pipeline": 2, "hybrid": 4}.get(cfg["parallel"]["scheme"], 1)
    for rank in range(ranks):
        graph = compose_for(make_job(cfg), ranks, rank)
        assert graph.ops and all(b.shape is not None for b in graph.blobs.values())


@pytest.mark.parametrize("job,batch", [("cifar10_quick.yaml", 4), ("nin_cifar10.yaml", 2),
                                       ("googlenet.yaml", 1)])
def test_job_trains_an_iteration(job, batch, digits_h5, tmp_path):
    cfg = load_config(os.path.join(REPO, "jobs", job), check_files=False,
                      overrides=[f"data.train.batch_size={batch}", "solver.max_iter=2"])
    cfg = synthetic_config(make_job(cfg))
    t = Trainer(cfg, str(tmp_path), world=FakeWorld(), log=lambda m: None)
    try:
        before = {p: np.array(t.ws[p]) for p in t.graphs.params}
        for it in range(2):
            t.ws["iter"][...] = it
            t.train.run(it)
        loss = sum(float(t.ws[b]) for b in t.graphs.losses)
        assert np.isfinite(loss)
        assert any(not np.array_equal(before[p], t.ws[p]) for p in t.graphs.params)
    finally:
        t.close()
