"""A job trained on the emulated device in a process of its own (a slow test
runs it beside the CPU's run of the same job):

    OPENBLAS_NUM_THREADS=1 python -m tests.emulated_gpu.train BUILD_DIR JOB OUT [KEY=VALUE ...]

BUILD_DIR: where the ``cuda/*.cu`` kernels are compiled for the host (the
``host_build_dir`` fixture's folder); JOB: a job file, KEY=VALUE its
overrides (``--set``'s); OUT: the run folder (``metrics.jsonl``). The
trainer runs as the emulated trainer tests run it (``emulated_trainer_env``).

One BLAS thread is required (``tests.conftest.cli_env`` sets it): the
emulated GEMMs are NumPy's, and OpenBLAS's results depend on its thread
count (gpt_tiny's validation loss after one step: 5.2839346 with one
thread, 5.2839437 with two), so its default (the cores) would give other
bits on another machine. It is faster too on shared cores: under pytest,
where NumPy is loaded before purine_mpi could hold BLAS to one thread
(purine_mpi/base/threads.py), gpt_tiny's attention GEMMs (32 products of
128x32 by 32x128) took 66 ms a call with two OpenBLAS threads on 2 loaded
cores, 1.7 ms with one."""
import os
import pathlib
import sys


def main(argv):
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":
        print("tests.emulated_gpu.train: set OPENBLAS_NUM_THREADS=1 (the emulated GEMMs' "
              "bits depend on OpenBLAS's thread count)", file=sys.stderr)
        return 2
    import pytest

    from purine_mpi.job.config import load_config
    from purine_mpi.train.trainer import Trainer, run_and_report
    from tests.conftest import FakeWorld, make_job
    from tests.emulated_gpu.helpers import emulated_trainer_env
    build, job, out, overrides = pathlib.Path(argv[0]), argv[1], argv[2], argv[3:]
    with pytest.MonkeyPatch.context() as monkeypatch:
        emulated_trainer_env(monkeypatch, build)
        trainer = Trainer(make_job(load_config(job, overrides=overrides)), out,
                          world=FakeWorld(), log=lambda line: None)
        return run_and_report(trainer, FakeWorld())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
