"""Shared fixtures for the core tests.

- ``digits_h5``: the digits data set as HDF5, made once per session with the
  real ``data digits`` command (tests never rely on ``data/`` in the repo).
- ``email_h5``, ``small_run``, ``digits_lenet_final``: a token file, a short
  run of the small net and the figures of jobs/digits_lenet.yaml, each made
  once per session for the tests that only read them.
- ``write_config``: writes a config mapping (or YAML text) to a file in
  ``tmp_path`` and returns its path.
- ``run_cli``: runs ``python -m purine_mpi ...`` as a subprocess from the repo
  root and returns the CompletedProcess (text mode); ``run_mpi_cli`` the
  same under ``mpiexec -n N`` (``MPIEXEC``: the venv's launcher, else PATH's);
  ``run_cli_here`` the same inside the pytest process, for a usage or config
  error found before MPI starts.
- ``FakeWorld``: a one-rank world for in-process Trainer runs, so the pytest
  process never initialises MPI; ``train_here`` a one-rank ``train`` run
  over it, in this process (the one-rank references).
- ``make_job``: the one way the tests make the ``Job`` that the package's
  entry points take.
"""
import email
import json
import os
import re
import shutil
import subprocess
import sys

# The product holds the BLAS pool to one thread before NumPy loads
# (purine_mpi/base/threads.py: every entry point imports it first); in this
# process NumPy may load before purine_mpi does, so the in-process tests
# would run OpenBLAS's own pool: other bits than a run's, and on a loaded
# 2-core machine small GEMMs up to 30x slower (measured on the emulated
# device's attention). A count the user set is kept.
for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile_once():
    """Byte-compile the package and the tests' helpers once per session.
    Most tests start ``python -m purine_mpi`` (often under ``mpiexec``, one
    interpreter a rank); where PYTHONDONTWRITEBYTECODE is set (this
    project's CI and build machines) no process leaves its .pyc behind, so
    each one compiled the package's ~200 modules again: 0.4-0.5 s of a
    1.2 s start-up, measured. Python reads a valid .pyc whatever that
    variable says, and checks it against the source's mtime and size, so an
    edited module is compiled afresh. The files go to the ``__pycache__``
    folders that .gitignore already names."""
    if not sys.flags.dont_write_bytecode:
        return  # every process writes its own as it imports
    import compileall
    compileall.compile_dir(os.path.join(REPO, "purine_mpi"), quiet=2, workers=1)
    # not the test files: pytest loads them rewritten (_share_the_rewriting)
    compileall.compile_dir(os.path.join(REPO, "tests"), quiet=2, workers=1,
                           rx=re.compile(r"[\\/]test_[^\\/]*\.py$"))


_compile_once()


def _share_the_rewriting(config):
    """Under pytest-xdist each worker collects every test file, and pytest
    rewrites each one's asserts as it imports it: ~11 s of CPU a worker for
    the suite's ~200 files (parsing, rewriting and compiling ~5,000 asserts;
    6 s of collection without it), the same work on every worker, at once,
    and done again each run where PYTHONDONTWRITEBYTECODE keeps pytest from
    caching it. Each worker rewrites its share of the files it will collect
    (every ``workercount``-th) before collecting, into the pytest pycs that
    its import reads (``__pycache__/*-pytest-*.pyc``, checked against the
    source's hash), so that every worker then finds the others' shares
    made; a share not made yet is rewritten by pytest itself, as before.
    Nothing changes in what is rewritten or how (pytest's own functions);
    a pytest without them rewrites as it always has."""
    worker = getattr(config, "workerinput", None)
    if worker is None or config.getoption("assertmode", "rewrite") != "rewrite":
        return
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc
        from _pytest.assertion.rewrite import assertstate_key, get_cache_dir
        state = config.stash[assertstate_key]
        index, count = int(worker["workerid"].lstrip("gw")), int(worker["workercount"])
    except (ImportError, KeyError, ValueError, AttributeError):
        return
    import fnmatch
    from pathlib import Path
    patterns = config.getini("python_files")
    files = set()
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::", 1)[0])
        walk = [(str(path.parent), [], [path.name])] if path.is_file() else os.walk(path)
        for root, dirs, names in walk:
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            files.update(Path(root, name) for name in names if name.endswith(".py") and
                         any(fnmatch.fnmatch(name, pattern) for pattern in patterns))
    for fn in sorted(files)[index::count]:
        try:
            pyc = get_cache_dir(fn) / (fn.name[:-3] + PYC_TAIL)
            if _read_pyc(fn, pyc) is None:
                source, co = _rewrite_test(fn, config)
                os.makedirs(pyc.parent, exist_ok=True)
                _write_pyc(state, co, source, pyc)
        except (OSError, SyntaxError):
            pass  # pytest's import says what is wrong with the file


def pytest_configure(config):
    _share_the_rewriting(config)


PYTHON = sys.executable
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


#: the emulated GPU's fixtures (``device``, ``backend``, ``host_device``)
pytest_plugins = ["tests.emulated_gpu.fixtures"]


def cli_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # the machine is shared: one BLAS thread per run keeps timings stable
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env.pop("PURINE_DISPATCHER", None)
    return env


def run_cli_args(*args, timeout=120, cwd=REPO):
    return subprocess.run([PYTHON, "-m", "purine_mpi", *map(str, args)], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=timeout)


def run_cli_here(*args, cwd=REPO):
    """``python -m purine_mpi ARGS`` run inside this process (``cli.main``,
    its environment and folder as ``run_cli_args`` gives them), for the
    tests of a usage or config error that the command finds before it
    starts MPI, and of the offline commands' output (``graph``, ``plan``:
    composed graphs, no MPI): the same CompletedProcess (the status ``main`` returns or
    exits with, stdout, stderr), without a new interpreter's ~0.5 s of
    imports. What only a process shows (its exit status, nothing printed at
    exit, no traceback) is checked by the tests that still run such errors
    as subprocesses (test_cli.py's malformed and missing config files and
    top-level --help). A call that reaches MPI fails the test (the pytest
    process keeps MPI out, ``FakeWorld``: ``mpi4py.MPI`` cannot be imported
    meanwhile, ``_hide_mpi``, also where an earlier test loaded it)."""
    args = [str(a) for a in args]
    import contextlib
    import io
    import signal

    from purine_mpi import cli
    from purine_mpi.runtime.stop import StopSignal
    env, here, run_env = dict(os.environ), os.getcwd(), cli_env()
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in StopSignal.CAUGHT}
    out, err = io.StringIO(), io.StringIO()
    hidden = _hide_mpi()
    try:
        os.environ.clear()
        os.environ.update(run_env)
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main(args)
            except SystemExit as exc:  # argparse's usage errors and --help
                status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except ImportError as exc:
        if "mpi4py.MPI" not in str(exc):
            raise
        raise AssertionError(f"purine_mpi {' '.join(args)} reached MPI: run it with "
                             "run_cli_args") from exc
    finally:
        _show_mpi(hidden)
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
    return subprocess.CompletedProcess([PYTHON, "-m", "purine_mpi", *args], status,
                                       out.getvalue(), err.getvalue())


def _hide_mpi():
    """Make ``mpi4py.MPI`` unimportable (ImportError) in this process, as it
    is in a command's own process before MPI starts, also where an earlier
    in-process test loaded it (the emulated NCCL, a real MPI request):
    hidden, not a reason to run the command as a subprocess (which made
    every later run_cli_here of that pytest worker a new interpreter:
    test_config_fuzz's sample 4 s alone, 37-50 s after one such test).
    The process-wide World, where one was made, is hidden too (a command
    that asks for it makes one: ImportError). Returns what ``_show_mpi``
    puts back."""
    loaded = sys.modules.get("mpi4py.MPI")
    package = sys.modules.get("mpi4py")
    attribute = None if package is None else package.__dict__.pop("MPI", None)
    sys.modules["mpi4py.MPI"] = None  # importing it raises ImportError
    world = sys.modules.get("purine_mpi.comm.world")
    made = None if world is None else world._WORLD
    if world is not None:
        world.set_world(None)
    return loaded, package, attribute, world, made


def _show_mpi(hidden):
    loaded, package, attribute, world, made = hidden
    if world is not None:
        world.set_world(made)
    if loaded is None:
        del sys.modules["mpi4py.MPI"]
    else:
        sys.modules["mpi4py.MPI"] = loaded
    if attribute is not None:
        package.MPI = attribute


def run_mpi_cli(n, *args, timeout=180):
    """``mpiexec -n N python -m purine_mpi ARGS`` from the repo root; skips the
    test when there is no mpiexec."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    return subprocess.run([MPIEXEC, "-n", str(n), PYTHON, "-m", "purine_mpi", *map(str, args)],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


def run_at_once(cmds, timeout=120, **popen):
    """``subprocess.run(cmd, capture_output=True, text=True)`` of each of
    ``cmds``, the launches all running at once: [CompletedProcess]; every
    one still running is killed when one fails. For launches that mostly
    wait (an agreement window, a timeout), whose waits then overlap; not
    for CPU-bound ones, which only share the 2 cores (30 start-up errors
    two at a time gained nothing measurable on the loaded machine)."""
    procs = []
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, **popen))
        outs = [proc.communicate(timeout=timeout) for proc in procs]
        return [subprocess.CompletedProcess(proc.args, proc.returncode, *out)
                for proc, out in zip(procs, outs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` (an issue's target that takes several minutes
    more than CI's ~20-minute budget leaves, e.g. gpt_tiny 300 iterations in
    bf16 on the emulated device) run with PURINE_LONG_TESTS=1 and are
    skipped otherwise, saying how to run them (the -ra summary lists them)."""
    if os.environ.get("PURINE_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long (minutes, outside CI's budget): run with "
                                   "PURINE_LONG_TESTS=1")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


#: tests/durations.json: each test file's seconds in a whole run on one
#: worker (its tests' setup, call and teardown summed), the pytest-xdist
#: scheduler's estimate of a file's cost; a file it lacks counts this much.
#: Refresh it from a run's ``--durations=0`` (or per-test timings) when files
#: are added or get much slower: it orders work, it decides no result
DEFAULT_FILE_SECONDS = 5.0

#: session fixtures whose runs are costly (minutes of training, several MPI
#: launches): the test files that use one run on the same pytest-xdist
#: worker, so that it is made once per session as without workers
SHARED_RUN_FIXTURES = ("digits_lenet_final", "train_once")


def _shared_run_groups(folder):
    """{test file's path relative to the repo: the SHARED_RUN_FIXTURES name
    it uses} for the test files under ``folder``."""
    groups = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            path = os.path.join(root, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for fixture in SHARED_RUN_FIXTURES:
                if re.search(rf"\b{fixture}\b", text):
                    groups[os.path.relpath(path, REPO).replace(os.sep, "/")] = fixture
                    break
    return groups


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n 2``, the README's command): each test file
    runs whole on one worker (its module fixtures made once, its tests in
    order), and the files that share a costly session run
    (SHARED_RUN_FIXTURES) run on one worker together. Each worker makes its
    own session fixtures; the cheap ones (the digits file, the 20-iteration
    small_run) are then made once per worker."""
    from xdist.scheduler import LoadScopeScheduling

    groups = _shared_run_groups(os.path.join(REPO, "tests"))
    with open(os.path.join(REPO, "tests", "durations.json"), encoding="utf-8") as f:
        seconds = json.load(f)

    class FilesAndSharedRuns(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return groups.get(path, path)

        def _assign_work_unit(self, node):
            # the costliest unit left first (tests/durations.json), so the
            # workers end together instead of one running a long file alone
            # at the end. The queue is reordered, not the collections: the
            # scheduler sends each worker indices into its own collection,
            # which must stay in the order the worker collected (sorting
            # them made a worker run the units' positions of the original
            # order: files split between units, their module fixtures made
            # twice, 38 s more for test_tensor_pipeline's 8-rank runs)
            def cost(unit):
                return sum(seconds.get(path, DEFAULT_FILE_SECONDS)
                           for path in {n.split("::", 1)[0] for n in self.workqueue[unit]})
            first = max(self.workqueue, key=cost)  # the first of equal costs
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return FilesAndSharedRuns(config, log)


@pytest.fixture
def run_cli():
    return run_cli_args


#: the email package of the standard library: the text the GPT tests train on
EMAIL = os.path.dirname(email.__file__)


@pytest.fixture(scope="session")
def email_h5(tmp_path_factory):
    """The byte-level token file ``data text`` makes of EMAIL's *.py files,
    once a session (the tests only read it)."""
    path = tmp_path_factory.mktemp("text") / "email.h5"
    res = run_cli_here("data", "text", "--from", EMAIL, "--glob", "*.py", "--out", path)
    assert res.returncode == 0, res.stderr
    return str(path)


@pytest.fixture(scope="session")
def text_h5(tmp_path_factory):
    """The byte-level token file ``data text`` makes of the json package's
    *.py files, once a session (the tests only read it): the GPT jobs'
    text data (their graphs read the vocabulary from the file)."""
    import json
    path = tmp_path_factory.mktemp("text") / "json.h5"
    res = run_cli_here("data", "text", "--from", os.path.dirname(json.__file__), "--glob",
                       "*.py", "--out", path)
    assert res.returncode == 0, res.stderr
    return str(path)


@pytest.fixture(scope="session")
def digits_h5(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "digits.h5"
    res = run_cli_here("data", "digits", "--out", path)
    assert res.returncode == 0, res.stderr
    assert path.exists()
    return str(path)


def write_config_file(directory, config, name="cfg.yaml"):
    path = os.path.join(str(directory), name)
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.fixture
def write_config(tmp_path):
    def write(config, name="cfg.yaml"):
        return write_config_file(tmp_path, config, name)
    return write


def make_job(config, path="<config>", **options):
    """The ``Job`` (job/job.py) of a config mapping, validated and resolved as
    the CLI does (``resolve_job``; ``options``: its ``overrides``, ``iters``,
    ``check_files``), or of a config already resolved (``resolve_config``,
    ``load_config``); a Job is returned as it is."""
    from purine_mpi.job.config import resolve_job
    from purine_mpi.job.job import Job, job_of
    if isinstance(config, Job):
        return config
    if "_path" in config:
        return job_of(config)
    return resolve_job(config, path, **options)


class FakeWorld:
    """One rank, no MPI: what Trainer needs from a World."""

    rank, size, comm = 0, 1, None

    def check_consistent(self, text, what=""):
        return ""

    def check_agreed(self, inputs, what=""):
        return None


def refused_trainer_run(job, out, error):
    """A one-rank Trainer of ``job`` into ``out`` (over ``FakeWorld``) whose
    run() must raise ``error``: (the trainer, pytest's info on the error),
    the trainer closed either way."""
    from purine_mpi.train.trainer import Trainer
    trainer = Trainer(job, str(out), world=FakeWorld(), log=lambda m: None)
    try:
        with pytest.raises(error) as info:
            trainer.run()
    finally:
        trainer.close()
    return trainer, info


def train_here(config, out, resume=None, lines=None):
    """``train CONFIG --out OUT [--resume CKPT]`` on one rank inside this
    process (``Trainer`` over ``FakeWorld``, ``run_and_report``): the same
    run folder (metrics.jsonl, the checkpoints, latest.h5), without a new
    interpreter's ~0.6 s of imports and MPI start-up. For the one-rank
    references that multi-rank runs are compared against, and the one-rank
    resumes of another layout's checkpoint; what only the command shows
    (its start-up block, train.log, its exit status) is read from
    ``run_cli_args``. ``config``: as ``make_job`` takes it, or a config
    file's path (read as the command reads it). ``lines``: a list that gets
    the run's own lines (its notes, "resumed from ...", the progress rows),
    or None. Returns ``out``."""
    import signal

    from purine_mpi.runtime.stop import StopSignal
    from purine_mpi.train.trainer import Trainer, run_and_report
    if isinstance(config, (str, os.PathLike)):
        from purine_mpi.job.config import load_job
        config = load_job(str(config))
    # the run's stop handlers (SIGINT, SIGTERM) go when it ends, as run_cli_here's
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in StopSignal.CAUGHT}
    try:
        log = (lambda line: None) if lines is None else lines.append
        trainer = Trainer(make_job(config), str(out), world=FakeWorld(), log=log,
                          resume=None if resume is None else str(resume))
        assert run_and_report(trainer, FakeWorld()) == 0
    finally:
        for name, handler in handlers.items():
            signal.signal(getattr(signal, name), handler)
    return out


def quiet_solver(max_iter=1, **keys):
    """A plain SGD solver section of ``max_iter`` iterations that prints
    nothing as it trains (no display, no test), updated with ``keys``."""
    solver = {"base_lr": 0.05, "momentum": 0.9, "lr_policy": "fixed", "max_iter": max_iter,
              "display": 0, "test_interval": 0}
    solver.update(keys)
    return solver


def small_net_config(data_path, **overrides):
    """A tiny LeNet-like config on the digits file (fast: fc on 8x8 inputs)."""
    cfg = {
        "name": "tiny",
        "seed": 3,
        "data": {"train": {"source": "hdf5", "path": data_path, "split": "train",
                           "batch_size": 16, "shuffle": True},
                 "test": {"source": "hdf5", "path": data_path, "split": "test",
                          "batch_size": 60, "shuffle": False}},
        "net": [
            {"type": "conv", "name": "conv1", "bottom": "data", "top": "conv1",
             "num_output": 4, "kernel": 3, "pad": 1},
            {"type": "relu", "name": "relu1", "bottom": "conv1", "top": "conv1"},
            {"type": "pool", "name": "pool1", "bottom": "conv1", "top": "pool1",
             "pool": "max", "kernel": 2, "stride": 2},
            {"type": "fc", "name": "fc1", "bottom": "pool1", "top": "fc1", "num_output": 10},
            {"type": "softmax_loss", "name": "loss", "bottom": ["fc1", "label"], "top": "loss"},
            {"type": "accuracy", "name": "acc", "bottom": ["fc1", "label"], "top": "acc",
             "phase": "test"},
        ],
        "solver": {"base_lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4,
                   "lr_policy": "fixed", "max_iter": 20, "display": 10, "test_interval": 0},
        "checkpoint": {"interval": 0, "keep": 3},
    }
    for k, v in overrides.items():
        cfg[k] = v
    return cfg


def cuda_cupy_or_skip():
    """CuPy, when it imports and sees a CUDA device; skips the test otherwise."""
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy without a driver
        count = 0
    if count < 1:
        pytest.skip("no CUDA device")
    return cupy


@pytest.fixture(scope="session")
def host_build_dir(tmp_path_factory):
    """Where the CUDA kernels are compiled with g++ to run on the host."""
    import shutil
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (needed to run the CUDA kernels on the host)")
    return tmp_path_factory.mktemp("host_kernels")


def final_figures(res):
    """The figures of a train run's last ``final {...}`` line (its stdout)."""
    final = [line for line in res.stdout.splitlines() if line.startswith("final ")]
    return json.loads(final[-1][len("final "):])


@pytest.fixture(scope="session")
def digits_lenet_final(digits_h5, tmp_path_factory):
    """The final figures of jobs/digits_lenet.yaml trained whole on the
    session's digits file: the "ours" side of the Caffe comparisons
    (tests/test_caffe_convert.py, tests/test_caffe_tree.py), trained once."""
    res = run_cli_args("train", os.path.join(REPO, "jobs", "digits_lenet.yaml"),
                       "--out", tmp_path_factory.mktemp("digits_lenet") / "run",
                       "--set", f"data.train.path={digits_h5}",
                       "--set", f"data.test.path={digits_h5}", timeout=300)
    assert res.returncode == 0, res.stderr
    return final_figures(res)


@pytest.fixture(scope="session")
def small_run(digits_h5, tmp_path_factory):
    """A 20-iteration run of the small digits net with checkpoints at 10 and
    20, trained once a session (tests/test_misuse.py,
    tests/test_no_silent_wrong.py, tests/test_trust_h5.py: they read its
    files, copy them, and write only new names in its ``dir``):
    {dir, cfg, path, out}."""
    d = tmp_path_factory.mktemp("small_run")
    cfg = small_net_config(digits_h5, checkpoint={"interval": 10, "keep": 5})
    path = write_config_file(d, cfg)
    out = d / "run"
    res = run_cli_args("train", path, "--out", out)
    assert res.returncode == 0, res.stderr
    return {"dir": d, "cfg": cfg, "path": path, "out": out}


@pytest.fixture(scope="session")
def train_once(tmp_path_factory):
    """``train_once(n, cfg, *extra)`` -> (run dir, stdout + stderr): ``train``
    of config ``cfg`` on ``n`` ranks (``mpiexec`` from 2) with the extra
    arguments, run once a session for every test that asks for the same
    ranks, config text, arguments and PURINE_* environment: the reference
    runs that several sharded tests compare against (tests/test_sharded*.py).
    The tests only read its files and text (a resume from it writes another
    folder); a test that means to run a job twice (determinism) calls
    run_cli_args / run_mpi_cli itself."""
    runs = {}

    def train(n, cfg, *extra, timeout=300):
        text = cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False)
        key = (n, text, tuple(map(str, extra)),
               tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PURINE_"))))
        if key not in runs:
            d = tmp_path_factory.mktemp("train_once")
            out = d / "run"
            args = ("train", write_config_file(d, text), "--out", out, *extra)
            res = run_mpi_cli(n, *args, timeout=timeout) if n > 1 else \
                run_cli_args(*args, timeout=timeout)
            assert res.returncode == 0, res.stdout + res.stderr
            runs[key] = (out, res.stdout + res.stderr)
        return runs[key]
    return train


def tiny_fc_config():
    """One fc layer on synthetic 1x4x4 data, one iteration: the smallest job
    that starts MPI and the graph (the thread-level tests)."""
    return {"name": "t", "data": {"train": {"source": "synthetic", "shape": [1, 4, 4],
                                            "classes": 3, "batch_size": 4}},
            "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                     "num_output": 3},
                    {"type": "softmax_loss", "name": "l", "bottom": ["fc", "label"],
                     "top": "l"}],
            "solver": {"max_iter": 1}}


def checkpoint_arrays(path):
    """{dataset path: array} of a checkpoint's ``params/`` and ``solver/``
    groups: what two runs compare bitwise."""
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset)
                     and k.startswith(("params/", "solver/")) else None)
    return out


def poisoned_copy(src, dst, dataset, value=float("nan")):
    """A copy of the checkpoint ``src`` at ``dst`` whose dataset ``dataset``
    (``params/fc1/weight``, ``solver/fc1/weight/momentum``) has its first
    element set to ``value`` (NaN; inf): the non-finite file the checks of
    --init, --resume and the exporters are tested on. Returns ``dst``."""
    import h5py
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        d = f[dataset]
        a = d[...]
        a.flat[0] = value
        d[...] = a
    return dst
