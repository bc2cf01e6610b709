"""``plan JOB.yaml --np N --choose``: the settings that fit, ranked by
predicted time per iteration; ``parallel.scheme: auto`` makes the same choice
at ``train``'s start-up (cli.py, ``resolve_auto``).

The candidates (``candidates``): data parallelism; scheme sharded at each
ZeRO stage the config language names (``job/schema.SHARD_STAGES``); each with
recompute none and full (and selective where the net has attention layers;
listed as "no effect" where they keep no (N, H, T, T) tensor to recompute:
the fused Attention op), at the job's micro-batch count and at the others
of ``micro_batch_counts`` (gradient accumulation; evaluated where they may
be the fastest that fits: ``variants_to_try``; the table shows one of
each setting's counts: ``shown``);
pipelines of 2..N stages dividing N (hybrid when fewer stages than ranks),
the layers cut into contiguous stages of about equal measured time, at a
few micro-batch counts (1, S, 2S, 4S dividing the batch); where fewer
stages than ranks, the same stages with each stage's replicas sharded at
each ZeRO stage (listed where the hybrid setting is possible); tensor
parallelism of each degree t >= 2 dividing N where it splits something in
the net (``tensor_parallel.splits_of``: an MLP's pair of fully connected
layers, an attention layer), and where t < N the same with each tensor
shard's replicas sharded at each ZeRO stage (listed where the tensor
setting is possible); and tensor parallelism within pipeline stages (scheme
pipeline with ``parallel.tensor_parallel``: one replica of p >= 2 stages x
t >= 2 tensor shards, N = p·t) where tensor parallelism splits something,
at the micro-batch counts of the pipelines of p stages, the stages cut by
the tensor shards' op times (``staged_settings`` with ``split_seconds``),
priced by the same predictor (every rank simulated:
each stage's tensor allreduces over its group, the transfers between the
stages). Each of these says ``parallel.mode=sync`` (a job of mode sync_ps
does not lend them its mode). Then parameter servers (``server_candidates``:
mode sync_ps with 1 .. N/2 servers, at the micro-batch counts; not mode
async): priced and listed, but not ranked with the others nor ever the
best (``PS_NOT_VALIDATED``: their prediction is not validated against
measurement). A degree that does not divide a split layer's width (or an
attention layer's heads) is listed as "not possible" with the reason. Each
is a list of ``--set`` overrides of the job; a candidate the config rules
or the scheme's layout refuse (a UserError) is listed as "not possible"
with the reason.

For each possible candidate: the bytes per rank (``plan``'s offline
footprint, the largest rank) against the memory each rank has, and the
predicted seconds per iteration of the scaling predictor
(``scaling/model.py``: the composed graph of each simulated rank, the
dispatcher's rule, the link model), its compute ops timed from TWO measured
traces of the job on one rank (``calibrate``: data parallel, no recompute,
no micro-batches; at the job's batch B and at ``small_batch``, B/4; cached
in a JSON file keyed by the job's net, data and solver). An op of a
candidate that the trace names otherwise takes the traced op's cost at its
work (``scaling/work.py``: the FLOPs of a matrix product, else the bytes of
the batch's blobs it touches, not the weights'): ``X@mbK`` (a micro-batch:
1/M of the batch), ``X@recompute`` (the forward again), a row chunk
``X[a:b]`` (a chunk of a weight gradient) and a
tensor-parallel shard of ``X`` (its part of the weight and of the output);
a shard's or chunk's update and the clipping norm are priced as
``predict`` prices them (``scaling/model.priced_by_trace``: its type's fixed
cost once plus its elements' share; the norm at the elements it reads);
the cost is affine in the work, fixed + rate * work, fitted per op from its
two traced times (``affine_costs``: a micro-batch pays the op's cost per
call M times), and proportional to the work where the two traces fit no
line (equal work, an op of one trace, an odd batch).

An element-wise op the trace does not name at all (a micro-batch's
gradient sum ``<grad>.micro_sum``, a copy or cast, the clipping of a
replica's summed gradient ``<grad>.sum.clip``: ``scaling/work.
ELEMENTWISE_KINDS``) takes its bytes written at the seconds per byte the
traced ops of its kind took (``elementwise_rates``: a sum at the traced
Sum and Eltwise ops' rate, a copy at the traced Copy and Cast ops', a
clipping at the traced ClipScale ops'); with
no traced op of its kind it is left to the predictor (``scaling/model.py``:
a Sum or Copy at the host's measured add rate, any other op 0 s) and
counted as untraced.
"""
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time

from ..base.errors import UserError
from ..base.runfiles import write_text_replacing
from ..base.progress_bar import human_bytes
from .scaling.simulate import SimulationStalled

#: the calibration run: iterations, and the traced window (the first ones warm up)
CALIBRATION_ITERS = 8
CALIBRATION_WINDOW = "3:8"
#: the calibration cache's format: 2 holds a second trace at a smaller batch
#: (``small``: the affine op cost); 3 each trace's dispatcher gap per op
#: (``gaps``: trace_reader.dispatch_gap, the cost per op apart from the cost
#: per iteration) and each op's least time (``fastest``: trace_reader.
#: op_minima, the fit of its cost per call); 4 the op times as CPU time and
#: the iteration and gaps over the trace's load factor (``load``:
#: trace_reader.read_traces with ``cpu``); a file of another format is
#: measured again
CALIBRATION_FORMAT = 4
#: the calibration file's key of the host's add rate (seconds per byte,
#: ``scaling/link.reduce_cost_per_byte``), measured with the traces: the
#: predictions price local adds and untraced copies at it, so one
#: calibration gives the same figures on every run (timed anew at each
#: start it made them differ by a few per cent from run to run)
ADD_RATE_KEY = "add_s_per_byte"
#: the calibration file's key of the host's copy rate (seconds per byte of a
#: copy beyond the cache, ``scaling/link.copy_cost_per_byte``): the CPU a
#: transfer between ranks sharing the node takes from their compute
#: (``scaling/link.shared_node``), kept for the same reason
COPY_RATE_KEY = "copy_s_per_byte"
#: the overrides that make the calibration run: one rank's plain data parallelism
CALIBRATION_SETS = ("parallel.scheme=data", "parallel.mode=sync", "parallel.micro_batches=1",
                    "parallel.stages={}", "parallel.tensor_parallel=1", "parallel.shard=1",
                    "recompute=none", "recompute_layers=null",
                    "solver.test_initialization=false",
                    # on a GPU a captured iteration's trace times each CUDA-graph
                    # replay, not its ops (trace_reader.replayed_ops): eager op
                    # times price every setting, an upper bound of the replay's
                    "cuda_graph=false")
#: how a candidate that would run as another one is listed (``recompute:
#: selective`` where the attention keeps no tensor for it to recompute)
NO_EFFECT = "no effect"
#: the mode every synchronous candidate sets (a job's mode sync_ps or async
#: is not inherited), and the parameter-server candidates'
SYNC_MODE = "parallel.mode=sync"
PS_MODE = "parallel.mode=sync_ps"
#: why the parameter-server candidates are priced and listed but not ranked
#: with the others, nor chosen by ``parallel.scheme: auto`` (``Candidate.
#: unranked``): their prediction is off the measured time either way
#: (docs/scaling.md "Parameter servers", 1 server + 1 worker, measured over
#: predicted: digits_lenet 8.04/1.94 ms, then 11.2 to 20.4/7.43 ms;
#: cifar10_quick_wide 0.305/0.532 s); one line under the table
PS_NOT_VALIDATED = ("the parameter-server model is not validated against measurement "
                    "(measured runs took 1.5x to 4.1x their predictions on digits_lenet, "
                    "0.57x on cifar10_quick_wide: docs/scaling.md)")
#: the most micro-batches (``parallel.micro_batches``) data parallelism and
#: scheme sharded are tried at (``micro_batch_counts``: powers of two)
MAX_MICRO_BATCHES = 16
#: the parallel/recompute keys a candidate sets (the calibration ignores them)
CHOSEN_KEYS = ("parallel", "recompute", "recompute_layers")
#: the environment of an MPI launcher, left out of the calibration's process
#: (it runs alone: a singleton MPI world)
_LAUNCHER_ENV = re.compile(r"^(PMI_|PMIX_|OMPI_|HYDRA_|HYDI_|MPIR_|MPI_LOCAL|PALS_|SLURM_)")


# ------------------------------------------------------------ calibration
def calibration_key(job):
    """A digest of what the op times depend on: the job without its
    parallel and recompute keys (and without its name and seed)."""
    cfg = job.to_config()
    for k in CHOSEN_KEYS + ("name", "seed", "_path", "checkpoint"):
        cfg.pop(k, None)
    text = json.dumps(cfg, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def small_batch(batch):
    """The calibration's second batch: B/4 where 4 divides B, else B/2 where
    2 does (the micro-batches ``candidates`` lists are B/S .. B/4S); None
    (one trace: the proportional rule) for an odd or unknown batch."""
    for d in (4, 2):
        if batch and batch % d == 0:
            return batch // d
    return None


def _calibration_json(cache):
    """The calibration file ``cache`` read as JSON: (its value, None), or
    (None, why) where it cannot be -- why None where there is no file, "is
    not readable JSON" where it is not JSON (read_calibration, _unread and
    host_copy_cost read it alike)."""
    if not cache or not os.path.isfile(cache):
        return None, None
    try:
        with open(cache, encoding="utf-8") as f:
            return json.load(f), None
    except (OSError, ValueError):
        return None, "is not readable JSON"


def read_calibration(cache, key, small_b):
    """(Durations at the job's batch, Durations at ``small_b`` or None, the
    host's add rate in seconds per byte or None) from the JSON file
    ``cache`` when it holds this job's (``key``) in this format
    (``CALIBRATION_FORMAT``) with its second trace at ``small_b``
    (``small_batch``); None otherwise: a file of another job, unreadable,
    or of an older format (one trace: measured again rather than read
    without its second run, or damaged: an entry not as ``_measure`` writes
    it, a time below zero, NaN, infinite or over ``MAX_CALIBRATION_S``
    (an hour), no iterations, a load factor
    not above zero -- a file edited by hand priced settings from them).
    The add rate is None in a file written before it was kept there."""
    from .scaling.trace_reader import Durations
    data, _ = _calibration_json(cache)
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT \
            or data.get("key") != key:
        return None

    def ranks(d, key, value, optional=False):
        # {rank: value} of entry ``key`` as _measure writes it; ValueError
        # where it is not (a damaged file: measured again)
        got = d.get(key) if optional else d[key]
        if got is None and optional:
            return {}
        if not isinstance(got, dict) or not all(value(v) for v in got.values()):
            raise ValueError(key)
        return {int(r): v for r, v in got.items()}

    def seconds(v):   # a time as _measure writes it: finite, 0 to MAX_CALIBRATION_S
        return isinstance(v, (int, float)) and not isinstance(v, bool) \
            and math.isfinite(v) and 0 <= v <= MAX_CALIBRATION_S

    def factor(v):   # a load factor (trace_reader.load_factor): above zero
        return seconds(v) and v > 0

    def by_op(v):
        return isinstance(v, dict) and all(seconds(t) for t in v.values())

    def durations(d):
        n = d.get("iterations") if isinstance(d, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("iterations")
        got = Durations(ranks(d, "per_rank", by_op),
                        ranks(d, "iter_seconds", lambda v: v is None or seconds(v)),
                        d["iterations"], ranks(d, "gaps", seconds, True),
                        ranks(d, "fastest", by_op, True))
        got.load = ranks(d, "load", factor, True)
        return got
    small = data.get("small")
    if not isinstance(small, (dict, type(None))) or (small or {}).get("batch") != small_b:
        return None
    add = data.get(ADD_RATE_KEY)
    try:  # a file damaged or edited by hand is unreadable: measured again
        found = durations(data), (durations(small) if small else None)
    except (KeyError, TypeError, ValueError):
        return None
    return found + ((float(add) if host_rate(add) else None),)


#: the longest time a calibration file's op time, gap or iteration is read
#: as (seconds): a calibration traces a few short iterations of one rank,
#: so an op over an hour is a file edited by hand or damaged (1e300 priced
#: every setting at 10^300 s, exit 0), measured again as the other damage
MAX_CALIBRATION_S = 3600.0

#: the slowest host rate (seconds per byte of a float32 add or copy: 100
#: kB/s, some 10^5 times below a host's memory) a calibration file's
#: ``ADD_RATE_KEY`` or ``COPY_RATE_KEY`` is read as: a figure above it (a
#: file edited by hand: 1e300 priced every setting's transfers at 10^290 s
#: and ranked them at 0 images/s, exit 0), not finite, or not above zero is
#: not a timing of this host's memory, and is timed again
MAX_HOST_S_PER_BYTE = 1e-5


def host_rate(v):
    """Whether ``v`` is a host rate as ``calibrate`` times it: a number
    (not a bool), finite, above zero, at most ``MAX_HOST_S_PER_BYTE``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and 0 < v <= MAX_HOST_S_PER_BYTE


def calibrate(job, path, overrides, cache, log=None):
    """(Durations at the job's batch, (Durations, job) at ``small_batch`` or
    None, the calibration job, the host's add rate in seconds per byte):
    op times of ``job`` measured on one rank, from ``cache`` (a JSON file)
    when it holds them for this job (``read_calibration``), else measured
    by two short traced runs of one rank (``train --profile-iters``: at the
    job's batch and at the smaller one) and written there, with the add
    rate (``ADD_RATE_KEY``; added to a file that lacks it)."""
    from .scaling.link import reduce_cost_per_byte
    key = calibration_key(job)
    small_b = small_batch(job.train_batch)
    small_sets = (f"data.train.batch_size={small_b}",)
    found = read_calibration(cache, key, small_b)
    if found is not None:
        durations, small, add = found
        if add is None:
            add = reduce_cost_per_byte()
            _keep_in_calibration(cache, ADD_RATE_KEY, add, "add", log)
    else:
        why = _unread(cache, key)
        if why and log:   # the file given was not used: why, before the runs
            log(f"calibration: {cache} {why}: measured again")
        add = reduce_cost_per_byte()
        durations, small = _measure(job, path, overrides, cache, key, small_b, small_sets, add,
                                    log)
    return (durations, (small, _calibration_job(path, overrides, small_sets)) if small else None,
            _calibration_job(path, overrides), add)


def _unread(cache, key):
    """Why ``read_calibration`` read nothing of the file ``cache`` (a
    phrase), or None where there is no file (nothing to say)."""
    data, why = _calibration_json(cache)
    if why is not None or not (cache and os.path.isfile(cache)):
        return why  # unreadable, or no file: nothing to say
    if not isinstance(data, dict):
        return "is not a calibration"
    if data.get("format") != CALIBRATION_FORMAT:
        return (f"is of calibration format {data.get('format', 1)!r} (this version reads "
                f"format {CALIBRATION_FORMAT}: op times as CPU time)")
    if data.get("key") != key:
        return f"holds another job's or setting's calibration ({data.get('job')!r})"
    return ("holds entries that are not a measurement's (a time below zero, NaN, "
            f"over {MAX_CALIBRATION_S:g} s, a key missing)")


def _keep_in_calibration(cache, key, rate, what, log=None):
    """Write the host's ``what`` rate ``rate`` under ``key`` into the
    calibration file ``cache`` (read by ``read_calibration``: a JSON
    object), read whole and replaced (``write_text_replacing``). A file
    whose mode forbids writing (chmod a-w: a file the user keeps as it is;
    its replacement by a rename would have dropped that mode) or a folder
    where it cannot be replaced keeps what it held: the rate, timed on this
    run, is used and ``log`` says it is not kept. Before, such a file was
    replaced all the same (a rename needs only the folder writable: its
    mode lost) or ``plan --choose`` ended with 'cannot be written there ...
    give another --out' (exit 2) though every op time it needed was in the
    file."""
    from ..base.errors import UserError
    with open(cache, encoding="utf-8") as f:
        data = json.load(f)
    data[key] = rate
    why = None
    if not os.stat(cache).st_mode & 0o222:
        why = "the file is read-only"
    else:
        try:
            write_text_replacing(cache, json.dumps(data))
        except (OSError, UserError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
    if why and log:
        log(f"calibration: {cache}: the host's {what} rate, timed, is used on this run "
            f"but not kept there ({why})")


def _measure(job, path, overrides, cache, key, small_b, small_sets, add, log):
    """``calibrate``'s two traced runs, written to ``cache``."""
    from ..base.runfiles import check_writable, folder_of, make_parent  # link/.. as read
    if cache:  # a folder there, a file in the way: one line (exit 2) before the runs
        check_writable(cache, "--calibration")
        from ..job.run_checkpoints import remove_stale_calibration_folders
        for gone in remove_stale_calibration_folders(folder_of(cache)):
            if log:
                log(f"removed {gone}, left by a calibration run that was killed")
    if log:
        batches = f"batch {job.train_batch}" + (f" and {small_b}" if small_b else "")
        log(f"calibration: timing the ops of {job.name} on one rank at {batches} "
            f"({CALIBRATION_ITERS} iterations each, data parallel) ...")
    t0 = time.perf_counter()
    base = folder_of(cache) if cache else "/tmp"
    durations = _traced_run(path, overrides, (), os.path.join(
        base, f".calibration-{key}-{os.getpid()}"))
    small = None
    if small_b:
        small = _traced_run(path, overrides, small_sets,
                            os.path.join(base, f".calibration-{key}-{os.getpid()}-small"))
    if cache:
        make_parent(cache, "--calibration")

        def entry(d):
            return {"per_rank": d.per_rank, "iter_seconds": d.iter_seconds,
                    "iterations": d.iterations, "gaps": d.gaps, "fastest": d.fastest,
                    "load": getattr(d, "load", {})}
        text = json.dumps({"format": CALIBRATION_FORMAT, "key": key, "job": job.name,
                           **entry(durations),
                           "small": dict(entry(small), batch=small_b) if small else None,
                           ADD_RATE_KEY: add,
                           "measured_s": round(time.perf_counter() - t0, 3)})
        write_text_replacing(cache, text)  # renamed over it: never through a link
    return durations, small


def _traced_run(path, overrides, sets, folder):
    """The Durations of one traced run of one rank (the calibration's
    settings, then ``sets``), written to ``folder`` and removed after."""
    import shutil
    from .scaling.trace_reader import read_traces
    cmd = [sys.executable, "-m", "purine_mpi", "train", os.path.abspath(path)]
    for s in tuple(overrides) + CALIBRATION_SETS + tuple(sets):
        cmd += ["--set", s]
    cmd += ["--iters", str(CALIBRATION_ITERS), "--profile-iters", CALIBRATION_WINDOW,
            "--out", folder, "--force", "--no-memory-check"]
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_ENV.match(k)}
    try:
        try:
            status, output = _run_child(cmd, env)
            if status != 0:
                tail = " | ".join(output.strip().splitlines()[-3:])
                raise UserError("plan --choose: the calibration run (one rank, data parallel"
                                + (f", {', '.join(sets)}" if sets else "")
                                + f") failed with status {status}: {tail}")
            # each op's CPU time, the iteration and the dispatcher's gaps over
            # the load factor: the one trace prices every setting, each then
            # run at the machine's load of its own moment, not the trace's
            durations, _ = read_traces(folder, cpu=True)
        finally:  # the child has ended (``_run_child``): nothing writes there any more
            shutil.rmtree(folder, ignore_errors=True)
    except _Forwarded as exc:
        _end_as_signalled(exc.signum)
    return durations


#: the signals that end ``plan --choose`` (or train's ``scheme: auto``)
#: while its calibration child runs: passed on to the child's process
#: group, then the parent ends as the signal asks (``_run_child``)
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
#: seconds the child's group has, after a forwarded signal, to end by its
#: own stop handling before it is killed (SIGKILL)
CHILD_GRACE_S = 3.0


class _Forwarded(BaseException):
    """A signal ``_run_child`` passed on to its child (a BaseException: no
    ``except Exception`` between the handler and ``_run_child`` keeps it)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _run_child(cmd, env):
    """(exit status, stdout and stderr) of the calibration's ``train``
    child ``cmd``, run in a session (and process group) of its own: a
    terminal's Ctrl-C does not reach it past this process, which passes
    each of ``FORWARDED`` on to the child's whole group (the child and
    anything it started) and then ends as that signal asks (its previous
    handler, raised again by ``_end_as_signalled`` once the group has
    ended and the caller removed its folder: ``_Forwarded`` says which).
    On every way out (a signal, an exception,
    this process's own end by SystemExit) the group gets ``CHILD_GRACE_S``
    after the signal to end, then SIGKILL; so the caller may remove the
    child's run folder: nothing writes to it any more. Before, a
    ``subprocess.run`` child ran on after ``timeout`` SIGTERMed ``plan
    --choose``, into a run folder in the user's tree."""
    import signal
    import threading
    main = threading.current_thread() is threading.main_thread()
    state = {"proc": None, "got": None}  # the child; the first signal passed on

    def forward(signum, frame):
        proc = state["proc"]
        if proc is not None:
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
        if state["got"] is None:  # once: a second one while the group ends is passed on only
            state["got"] = signum
            if proc is not None:
                raise _Forwarded(signum)
            # the child not held yet (its Popen under way): raised once it is,
            # else the Popen object, and the child with it, were lost
    previous = {}
    try:
        if main:
            for name in FORWARDED:
                sig = getattr(signal, name)
                old = signal.getsignal(sig)
                if old is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                    previous[sig] = old
                    signal.signal(sig, forward)
        output = ""
        try:
            state["proc"] = subprocess.Popen(_dying_with_this(cmd) if main else cmd,
                                             env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True,
                                             start_new_session=True)
            if state["got"] is not None:  # a signal came while it started
                try:
                    os.killpg(state["proc"].pid, state["got"])
                except (ProcessLookupError, PermissionError):
                    pass
                raise _Forwarded(state["got"])
            output, _ = state["proc"].communicate()
        except _Forwarded:
            pass
    finally:
        try:
            if state["proc"] is not None:
                _end_group(state["proc"], state["got"] is not None)
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
    if state["got"] is not None:
        raise _Forwarded(state["got"])  # the caller cleans up, then ``_end_as_signalled``
    return state["proc"].returncode, output


#: ``_dying_with_this``'s start of the child: the kernel's parent-death
#: signal set (Linux's prctl PR_SET_PDEATHSIG, 1: SIGKILL), the child
#: ended at once where its parent (argv[1]) has gone already, then the
#: command (argv[2:]) run in its place; where there is no prctl, the
#: command alone
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(128 + int(signal.SIGKILL))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def _dying_with_this(cmd):
    """``cmd`` (its argv[0] an executable's path) started so that the kernel
    kills it (SIGKILL) when this process ends without ending it: killed
    outright (``kill -9``, the OOM killer, mpiexec's second Ctrl-C on rank
    0 of ``parallel.scheme: auto``), where no handler runs to pass a signal
    on. Before, the calibration child, in a session of its own, ran on
    until its next line met the closed pipe, then stopped as on SIGTERM,
    writing a checkpoint into its run folder (50 MB on
    tests/test_choose_signals.py's net; 353 MB on a 6144-wide one). The
    parent-death signal follows the thread that started the child: the
    main thread only (``_run_child``)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def _end_as_signalled(signum):
    """After the child's group has ended and its folder is removed: the
    signal ``signum`` raised again at its previous handler (SIG_DFL: this
    process ends by it, as ``timeout`` and the shell expect; SIGINT's:
    KeyboardInterrupt, the CLI's "interrupted" and 130); where that
    handler only records it (train's early stop handler, ``parallel.
    scheme: auto``), a UserError ends the choice."""
    import signal
    signal.raise_signal(signum)
    raise CalibrationStopped(signum)


class CalibrationStopped(UserError):
    """The calibration's child stopped by a signal that this process only
    records (``train``'s early stop handler under ``parallel.scheme:
    auto``): the job ends with the signal's status, 128 + its number (143
    for SIGTERM, as ``train`` stopped anywhere else), not a config error's
    2, so a batch script that requeues on 143 sees the stop it asked for."""

    def __init__(self, signum):
        import signal
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"the calibration run was stopped by "
                         f"{signal.Signals(signum).name} before the run began")


def _end_group(proc, signalled):
    """End ``proc``'s process group (its own session, ``_run_child``): it
    has ``CHILD_GRACE_S`` when a signal was passed on to it, else none (an
    exception here: SIGTERM first, then the same grace); then SIGKILL to
    whatever of the group is left, and the child reaped. The shared-memory
    files under /dev/shm the processes killed so had mapped are removed
    (``_group_shm``): a process ended by SIGKILL never removes its own,
    and MPICH's singleton ``train`` keeps its segment (``mpich_shm_*``,
    1 MiB) named until MPI_Finalize: before, a calibration whose iteration
    outlasted the grace (SIGTERM stops ``train`` at the end of its
    iteration) left one in /dev/shm at every stop."""
    import signal
    if proc.poll() is None and not signalled:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=CHILD_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    mapped = _group_shm(proc.pid)  # what the group still running holds
    try:  # the child's own children too: the group outlives its leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if mapped:
        _remove_shm(mapped)
    if proc.stdout is not None:
        proc.stdout.close()


#: where the shared-memory files a killed calibration held live (Linux)
SHM_DIR = "/dev/shm/"


def _group_shm(pgid):
    """{pid: the files under ``SHM_DIR`` it maps} of the processes of
    process group ``pgid`` that are still running (``/proc``; {} where
    there is none to read)."""
    out = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return out
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/maps") as f:
                files = {line.split(None, 5)[5].strip() for line in f
                         if len(line.split(None, 5)) == 6}
        except (OSError, ValueError, IndexError):
            continue
        files = {p for p in files if p.startswith(SHM_DIR) and "/" not in p[len(SHM_DIR):]}
        if files:
            out[int(entry)] = files
    return out


def _remove_shm(mapped):
    """Remove the files of ``mapped`` (``_group_shm``, read before its
    process group was killed) that are still there, are this user's, and that no
    process maps any more (none outside the group shared them)."""
    files = set().union(*mapped.values())
    uid = os.getuid()
    still = set()
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return
    for entry in entries:  # a file another process maps (outside the group) stays
        try:
            with open(f"/proc/{entry}/maps") as f:
                still.update(p for p in (line.split(None, 5)[5].strip() for line in f
                                         if len(line.split(None, 5)) == 6) if p in files)
        except (OSError, IndexError):
            continue
    for path in sorted(files - still):
        try:
            if os.stat(path).st_uid == uid:
                os.unlink(path)
        except OSError:
            pass


def _calibration_job(path, overrides, sets=()):
    from ..job.config import load_job
    return load_job(path, tuple(overrides) + CALIBRATION_SETS + tuple(sets), check_files=False)


# ------------------------------------------------------------- candidates
@dataclasses.dataclass
class Candidate:
    """One setting: its ``--set`` overrides and a short label."""

    sets: tuple
    label: str
    job: object = None
    error: str = None
    need: dict = None          # {"host": bytes, "GPU d": bytes}: the largest rank's
    limits: dict = None        # {where: (bytes, why)}
    iter_s: float = None
    samples: int = None
    untraced: int = 0
    after: object = None       # a Candidate whose refusal makes this one go unlisted
    variant_of: object = None  # the plain setting this one is at other micro-batches of
    micro: int = None          # its micro-batch count (a variant's)
    not_tried: str = None      # a variant left out by ``variants_to_try``: a NOT_TRIED key
    swept: str = None          # a plain setting whose every count ``variants_to_try``'s
                               # check had evaluated: why (a larger count predicted faster)
    unranked: str = None       # why it is listed after the ranked ones, never the best

    @property
    def listed(self):
        """Whether it is listed: every Candidate it comes ``after`` possible."""
        c = self.after
        while c is not None:
            if c.error is not None:
                return False
            c = c.after
        return True

    @property
    def fits(self):
        return self.error is None and all(self.need.get(w, 0) <= lim
                                          for w, (lim, _) in self.limits.items())

    def set_line(self):
        return " ".join(f"--set {_quote(s)}" for s in self.sets)


def _quote(s):
    return f"'{s}'" if re.search(r"[\s{}:,]", s) else s


def has_attention(job):
    return any(layer.get("type") == "attention" for layer in job.net or ())


def selective_no_effect(job):
    """Why ``recompute: selective`` changes nothing in ``job`` (its
    attention layers keep no (N, H, T, T) tensor: the fused Attention op),
    in words; None where it recomputes something. The replica's training
    graph built with it, as job/replica.py builds it."""
    from ..graph.recompute import describe_recompute
    from ..job.replica import build_train_graph
    graph, _ = build_train_graph(job)
    summary = graph.recompute or {}
    if summary.get("setting") != "selective" or summary.get("units"):
        return None
    return describe_recompute(graph).split(": ", 2)[-1]


def balanced_stages(job, stages, durations, seconds=None):
    """{layer: stage}: the net's layers cut into ``stages`` contiguous runs
    of about equal traced time (a layer's ops are named ``layer.*`` or
    ``layer/*``; a layer without traced ops weighs as its share of the
    least); a layer's middle past k/S of the whole starts stage k.
    ``seconds``: (op, traced seconds) -> the seconds the op takes in the
    setting cut (``split_seconds``: a tensor shard's), None: as traced."""
    from ..job.stage_cut import contiguous_cut, op_layer
    names = list(job.layer_names)
    ops = durations.per_rank.get(min(durations.per_rank), {}) if durations.per_rank else {}
    weight = {n: 0.0 for n in names}
    for op, s in ops.items():
        layer = op_layer(op)
        if layer in weight:
            weight[layer] += s if seconds is None else seconds(op, s)
    return contiguous_cut(names, [weight[n] for n in names], stages)


def split_seconds(job, t, predictor):
    """(op, traced seconds) -> its seconds on a rank of ``t``-way tensor
    parallelism (``balanced_stages``' ``seconds``): the op of tensor shard
    0's graph (``compose_for`` of ``parallel.scheme: tensor``, the shards
    alike) priced as the predictor prices it (``_Scaled``: the traced time
    at the split op's work, a split matrix product at 1/t of its FLOPs); an
    op the split graph lacks keeps its traced time. None without a
    ``predictor`` (``candidates`` called for the labels only)."""
    if predictor is None:
        return None
    import dataclasses
    from .graph import compose_for
    split = job.replace(parallel=dataclasses.replace(job.parallel, scheme="tensor",
                                                     tensor_parallel=t, stages={},
                                                     micro_batches=1))
    graph = compose_for(split, t, 0)
    scaled = _Scaled(predictor.durations, predictor.traced, graph, predictor.fit,
                     predictor.rates)

    def seconds(op, s):
        got = scaled.lookup(op) if op in graph.ops else None
        return s if got is None else got
    return seconds


def _stages_label(stage_map, stages):
    firsts = [next(n for n, s in stage_map.items() if s == k) for k in range(stages)]
    return "|".join(firsts)


def candidates(job, n, durations, predictor=None):
    """The Candidates for ``n`` ranks (see the module docstring);
    ``predictor``: prices the tensor shards' ops the stages of tensor
    parallelism within pipeline stages are cut by (``split_seconds``)."""
    from ..job.schema import SHARD_STAGES
    from ..parallel.schemes import scheme_class
    from ..parallel.tensor_parallel import splits_of
    out = []
    modes = ["none", "full"] + (["selective"] if has_attention(job) else [])
    counts = micro_batch_counts(job)
    for mode in modes:
        plain = Candidate(("parallel.scheme=data", f"recompute={mode}"),
                          f"data, recompute {mode}")
        out.append(plain)
        out += micro_batched(plain, counts)
    sharded = n > 1 and scheme_class("sharded") is not None
    if sharded:
        for stage in SHARD_STAGES:
            # the other recompute modes are tried only when recompute none
            # is possible (``evaluate``: ``Candidate.after``)
            first = None
            for mode in modes:
                c = Candidate(("parallel.scheme=sharded", f"parallel.shard={stage}",
                               f"recompute={mode}"), f"sharded stage {stage}, recompute {mode}",
                              after=first)
                first = first or c
                out.append(c)
                out += micro_batched(c, counts)
    for s in range(2, n + 1):
        if n % s:
            continue
        scheme = "pipeline" if s == n else "hybrid"
        for text, m, what in staged_settings(job, s, durations):
            staged = Candidate((f"parallel.scheme={scheme}", f"parallel.stages={text}",
                                f"parallel.micro_batches={m}"), f"{scheme} {what}")
            out.append(staged)
            if s < n and sharded:
                # each stage's n/s replicas shard that stage's model state
                # (listed where the same hybrid setting is possible)
                for stage in SHARD_STAGES:
                    out.append(Candidate(("parallel.scheme=sharded", f"parallel.shard={stage}",
                                          f"parallel.stages={text}",
                                          f"parallel.micro_batches={m}"),
                                         f"sharded stage {stage} x {what}", after=staged))
    # tensor parallelism where it splits something: an MLP's fc pair or an
    # attention layer (tensor_parallel.find_splits, what the scheme splits)
    if n > 1 and splits_of(job):
        for t in range(2, n + 1):
            if n % t == 0:
                tensor = Candidate(("parallel.scheme=tensor", f"parallel.tensor_parallel={t}"),
                                   f"tensor {t}-way")
                out.append(tensor)
                if t < n and sharded:
                    # each tensor shard's n/t replicas shard its model state
                    # (listed where the same tensor setting is possible)
                    for stage in SHARD_STAGES:
                        out.append(Candidate(("parallel.scheme=sharded",
                                              f"parallel.shard={stage}",
                                              f"parallel.tensor_parallel={t}"),
                                             f"sharded stage {stage} x tensor {t}-way",
                                             after=tensor))
        # tensor parallelism within pipeline stages: one replica of p >= 2
        # stages x t >= 2 tensor shards (scheme pipeline), the stages and
        # micro-batches those of the pipeline of p stages
        for t in range(2, n // 2 + 1):
            if n % t:
                continue
            # the stages balanced by the tensor shards' op times: a split
            # layer takes about 1/t of its traced time, the others all of it
            for text, m, what in staged_settings(job, n // t, durations,
                                                 split_seconds(job, t, predictor)):
                out.append(Candidate(("parallel.scheme=pipeline", f"parallel.stages={text}",
                                      f"parallel.micro_batches={m}",
                                      f"parallel.tensor_parallel={t}"),
                                     f"pipeline {what} x tensor {t}-way"))
    # every setting above is synchronous data/model parallelism: its mode
    # said, so that a job of mode sync_ps or async does not lend it its own
    for c in out:
        c.sets += (SYNC_MODE,)
    out += server_candidates(job, n, counts)
    return out


def server_candidates(job, n, counts):
    """The parameter-server settings (``parallel.mode: sync_ps``) on ``n``
    ranks: K = 1 .. n/2 servers (``ps_ranks``: the last K ranks hold the
    weights, the other n - K compute; no more servers than workers), each at
    the job's micro-batch count and at the others of ``counts``, recompute
    none; a rule the parameter servers break (a solver other than SGD, early
    stopping, clipping with more than one server: job/config.py) lists it as
    not possible with the reason. Mode async is not offered: it trains with
    stale weights (other maths than the synchronous settings), and the
    predictor prices it as sync_ps (the staleness is not modelled): no
    prediction tells when it would be faster. Each is ``unranked``
    (``PS_NOT_VALIDATED``): priced and listed, never the best."""
    out = []
    for k in range(1, n // 2 + 1):
        plain = Candidate(("parallel.scheme=data", PS_MODE, f"parallel.ps_ranks={k}",
                           "recompute=none"),
                          f"parameter servers: {k} server{'s' if k > 1 else ''}, "
                          f"{n - k} worker{'s' if n - k > 1 else ''}",
                          unranked=PS_NOT_VALIDATED)
        out.append(plain)
        out += micro_batched(plain, counts)
    return out


def micro_batch_counts(job):
    """The micro-batch counts (``parallel.micro_batches``: gradient
    accumulation, the global batch unchanged) data parallelism and scheme
    sharded are tried at besides the job's own: 1, 2, 4, .. up to
    ``MAX_MICRO_BATCHES`` that divide the per-rank batch, less the job's
    own count (its setting is the plain row)."""
    batch, own = job.train_batch or 1, job.parallel.micro_batches
    counts, m = [], 1
    while m <= min(batch, MAX_MICRO_BATCHES):
        if batch % m == 0 and m != own:
            counts.append(m)
        m *= 2
    return counts


def micro_batched(plain, counts):
    """The Candidates of ``plain`` (a data or sharded setting at the job's
    micro-batches) at each of ``counts`` (``micro_batch_counts``): listed
    where ``plain`` is (``Candidate.after``), grouped under it
    (``Candidate.variant_of``: the table shows one of them)."""
    return [Candidate(plain.sets + (f"parallel.micro_batches={m}",),
                      f"{plain.label}, {m} micro-batch{'es' if m > 1 else ''}",
                      after=plain, variant_of=plain, micro=m, unranked=plain.unranked)
            for m in counts]


#: why ``variants_to_try`` left a micro-batch count out: (key, words)
NOT_TRIED = {
    "smaller_fits": "a smaller count fits, and the count above it is predicted no faster "
                    "(by the model's op costs a larger one is no faster)",
    "not_possible": "the count tried before it is not possible",
}


def _per_sample(c):
    """``c``'s predicted seconds per sample (``rank``'s key)."""
    return c.iter_s / max(c.samples, 1) if c.iter_s else 0.0


def variants_to_try(plain, variants, own, evaluate):
    """Evaluate (``evaluate(candidate)``) the micro-batch variants of the
    evaluated setting ``plain`` (at the job's own count ``own``) that may
    be the fastest that fits; the list of those evaluated. The counts are
    walked in ascending order (``plain`` among them, evaluated already): up
    to the first that fits, then one more, the check (the next possible
    count; above ``own``, one not possible ends the walk): where it is predicted
    no faster per sample than the one that fits, the counts above it are
    left out (a larger count taken to be no faster); where it is faster,
    every count of the setting is evaluated and ``plain.swept`` says why.
    Above ``own``, a count whose predecessor is not possible ends the walk.

    Why a check and not a proof: by the model's op costs a larger count is
    no faster (each op's fixed cost, ``affine_costs``, clamped at 0 and up,
    and the dispatcher's cost per op are paid per micro-batch, the
    proportional part is the same, and the gradient sums come on top), but
    the simulated iteration overlaps ops and messages, and smaller ops may
    overlap better; in every case measured it did not (gpt_tiny,
    cifar10_quick, gpt_small, cifar10_quick_wide, tests/test_choose.py's
    and tests/test_choose_all.py's nets, where ``plan --choose-all``
    evaluates every count). The check sees a fall at the count next to the
    one that fits; a fall further up past a rise it does not
    (``--choose-all`` does). The bytes are no guide: where the weights'
    gradients dominate, 2 micro-batches hold more than 1 (the gradients'
    running sum) while 4 may hold less than 1 (tests/test_choose_all.py:
    the rule that stopped at a count holding more than the one before left
    out the only count that fit). Each variant left out gets ``not_tried``:
    the ``NOT_TRIED`` key of the stop (``plan --choose --json``'s
    ``not_tried``)."""
    done = []
    ladder = sorted(variants, key=lambda v: v.micro)
    at = sum(1 for v in ladder if v.micro < own)
    ladder.insert(at, plain)
    fit = None  # the first count that fits
    for i, v in enumerate(ladder):
        if v is not plain:
            if i > at and ladder[i - 1].error is not None:
                for rest in ladder[i:]:
                    rest.not_tried = "not_possible"
                break
            evaluate(v)
            done.append(v)
        if fit is not None and plain.swept is None:  # v: the check's count
            if v.error is not None:  # not possible: the next count is the check's
                continue
            if _per_sample(v) < _per_sample(fit):
                plain.swept = (f"{v.micro or own} micro-batches predicted faster than "
                               f"{fit.micro or own} ({v.iter_s:.4g} s/iter against "
                               f"{fit.iter_s:.4g}): every count evaluated")
                continue
            for rest in ladder[i + 1:]:
                rest.not_tried = "smaller_fits"
            break
        if fit is None and v.error is None and v.fits:
            fit = v
    return done


def staged_settings(job, s, durations, seconds=None):
    """The staged settings of ``s`` stages ``candidates`` lists: (the
    ``parallel.stages`` text, micro-batches, its words) for the layers cut
    into ``s`` stages of about equal traced time (``balanced_stages``) at
    each micro-batch count 1, s, 2s, 4s dividing the batch; none where the
    net has fewer layers than ``s``. The text is the integer ``s`` where the
    cut is the one ``parallel.stages: s`` makes (job/stage_cut.py: balanced
    by the layers' FLOPs), else the map. ``seconds``: ``balanced_stages``'."""
    if s < 2 or len(job.layer_names) < s:
        return []
    from ..job.stage_cut import flop_cut
    batch = job.train_batch or 1
    stage_map = balanced_stages(job, s, durations, seconds)
    text = str(s) if flop_cut(job, s) == stage_map else \
        "{" + ", ".join(f"{k}: {v}" for k, v in stage_map.items()) + "}"
    return [(text, m, f"{s} stages ({_stages_label(stage_map, s)}), "
                         f"{m} micro-batch{'es' if m > 1 else ''}")
            for m in sorted({1, s, 2 * s, 4 * s}) if batch % m == 0]


# ------------------------------------------------------------- evaluation
class _Scaled:
    """The calibration's Durations seen from a candidate's graph: an op the
    trace names otherwise (``@mbK``, ``@recompute``, a row chunk, a tensor
    shard) takes the traced op's cost at its work (``scaled_seconds``:
    ``scaling/work.op_work``, FLOPs of a matrix product, else the bytes of
    the batch's blobs it touches; the weights' bytes do not scale with a
    micro-batch): the affine law ``fit`` where the two traces fit one
    (``affine_costs``), else the proportional rule. An element-wise op the
    trace does not name: its bytes written at ``rates`` of its kind
    (``elementwise_rates``); None (untraced) without one."""

    def __init__(self, durations, traced_graph, graph, fit=None, rates=None):
        from .scaling.work import weight_blobs
        self.d, self.traced, self.graph, self.fit = durations, traced_graph, graph, fit
        self.rates = rates or {}
        self._weights = {id(g): weight_blobs(g) for g in (traced_graph, graph)}

    def lookup(self, name, rank=0, rows=None, fixed=0.0):
        from .scaling.model import priced_by_trace
        if name in self.graph.ops and priced_by_trace(self.graph, name):
            # clip.norm, a shard's update: the predictor's own rule
            # (``Template.rank_graph``'s reads and fixed costs), as predict's
            return self.d.lookup(name, rank, rows, fixed)
        # a copy named apart from a blob of its name: ``X@recompute#1`` (graph/core.free_name),
        # a micro-batch's copy of a recompute copy: ``X@recompute#1@mb0``;
        # a fused Attention copy reading the packed mask (``replay_mask``) keeps the
        # original's time, its mask draw included: nothing traced times the draw apart
        # (docs/scaling.md, "What it leaves out")
        base = re.sub(r"(@(recompute|mb\d+)(#\d+)?)+$", "", name)
        whole = re.sub(r"\[\d+:\d+\]$", "", base)
        seconds = self.d.lookup(whole, 0)
        if seconds is None or whole not in self.traced.ops or name not in self.graph.ops:
            seconds = self.d.lookup(name, 0, rows)
            if seconds is None and name in self.graph.ops:
                seconds = elementwise_seconds(self.graph, name, self.rates)
            return seconds
        return scaled_seconds(seconds, self.traced, whole, self.graph, name, self._weights,
                              self.fit)


def elementwise_rates(durations, traced):
    """{kind: seconds per byte written} of the element-wise ops the graph
    ``traced`` holds and ``durations`` times (``scaling/work.
    ELEMENTWISE_KINDS``): their total time over their total bytes written,
    per kind; a kind with no traced op is absent."""
    from .scaling.model import _nbytes
    from .scaling.work import ELEMENTWISE_KINDS
    seconds, nbytes = {}, {}
    for name, op in traced.ops.items():
        kind, t = ELEMENTWISE_KINDS.get(op.op_type), durations.lookup(name, 0)
        written = _nbytes(traced, op.outputs) if kind and t is not None else 0
        if written > 0:
            seconds[kind] = seconds.get(kind, 0.0) + t
            nbytes[kind] = nbytes.get(kind, 0) + written
    return {k: seconds[k] / nbytes[k] for k in seconds}


def elementwise_seconds(graph, name, rates):
    """Op ``name`` of ``graph`` priced at ``rates`` (``elementwise_rates``):
    its bytes written times the rate of its kind; None where it is no
    element-wise op or its kind has no rate."""
    from .scaling.model import _nbytes
    from .scaling.work import ELEMENTWISE_KINDS
    op = graph.ops[name]
    rate = rates.get(ELEMENTWISE_KINDS.get(op.op_type))
    return None if rate is None else _nbytes(graph, op.outputs) * rate


def affine_costs(durations, traced, small, small_graph):
    """{op name: (unit, fixed, rate)}: the affine cost (``scaling/work.
    affine_fit``) of each op that both traces time, ``durations`` of the
    graph ``traced`` at the job's batch and ``small`` of ``small_graph`` at
    a smaller one, where its work differs between them in one unit; ops of
    equal work (a weight's update) and ops of one trace are left out (the
    proportional rule). Empty without a small trace.

    The fixed part (the cost per call) is fitted from the op's least time
    in one traced iteration of each trace (``Durations.least``: the time
    least disturbed by other work on the machine; a median of four
    iterations, one or two of them slowed, made a max pool's call cost 3 ms
    of its 8), as a share of the least time at the job's batch, and taken
    at that share of the op's median there (other work slows the call's
    fixed and proportional parts alike), at most either median; the rate
    then keeps the op's median at the job's batch, so the job's own ops
    keep their traced times."""
    from .scaling.work import affine_fit, op_work, weight_blobs
    if small is None or small_graph is None:
        return {}
    weights = (weight_blobs(traced), weight_blobs(small_graph))
    out = {}
    for name in traced.ops:
        t_big, t_small = durations.lookup(name, 0), small.lookup(name, 0)
        if name not in small_graph.ops or t_big is None or t_small is None:
            continue
        big, little = op_work(traced, name, weights[0]), op_work(small_graph, name, weights[1])
        least = durations.least(name, 0)
        fit = affine_fit(least, big[1], small.least(name, 0), little[1]) \
            if big[0] == little[0] and least > 0 else None
        if fit is not None:
            # the fixed part's share of the op at the job's batch, undisturbed,
            # of the op's median there (other work slows both parts alike)
            fixed = min(fit[0] / least * t_big, t_big, t_small)
            out[name] = (big[0], fixed, (t_big - fixed) / big[1])
    return out


def scaled_seconds(seconds, traced, whole, graph, name, weights=None, fit=None):
    """``seconds`` of op ``whole`` of the graph ``traced``, priced for op
    ``name`` of ``graph`` at its work: ``fixed + rate * work`` where ``fit``
    (``affine_costs``) holds ``whole`` in the unit ``name``'s work is
    counted in, else ``seconds`` times the ratio of the two ops' work
    (``_Scaled``). ``weights``: {id of a graph: its ``weight_blobs``},
    computed when not given."""
    from .scaling.work import op_work
    weights = weights or {}
    now = op_work(graph, name, weights.get(id(graph)))
    law = (fit or {}).get(whole)
    if law is not None and law[0] == now[0]:
        return law[1] + law[2] * now[1]
    was = op_work(traced, whole, weights.get(id(traced)))
    if was[0] != now[0]:
        was, now = ("bytes", _touched(traced, whole)), ("bytes", _touched(graph, name))
    return seconds * (now[1] / was[1]) if was[1] > 0 else seconds


def _touched(graph, name):
    op = graph.ops[name]
    return sum(graph.blobs[b].nbytes for b in set(op.inputs) | set(op.outputs)
               if b in graph.blobs and graph.blobs[b].shape is not None)


class Predictor:
    """The scaling predictor, calibrated once, for any candidate job."""

    def __init__(self, calib_job, durations, link, algorithm="auto", small=None, add=None,
                 ranks_per_node=None):
        """``small``: (Durations, job) of the calibration's second trace at
        a smaller batch (``calibrate``), or None: the proportional rule;
        ``add``: the host's add rate (``calibrate``), None: timed now;
        ``ranks_per_node``: K of the correction for ranks sharing a node
        where ``link`` holds its measurements (``plan --ranks-per-node``;
        None: the link file's calibration's, else 1), ``predict``'s rule
        (``scaling/node.scales``)."""
        from .graph import compose_for
        from .scaling.link import reduce_cost_per_byte
        from .scaling.model import dispatch_overhead, trace_prices
        from .scaling.node import scales
        self.durations, self.link, self.algorithm = durations, link, algorithm
        self.copy_cost = reduce_cost_per_byte() if add is None else add
        traced_n = len(durations.per_rank)
        self.ranks_per_node, self.scale = scales(link, traced_n, ranks_per_node)
        self.overhead, self.per_iteration = dispatch_overhead(
            calib_job, durations, link, algorithm, self.copy_cost, {}, self.scale(traced_n))
        self.traced = compose_for(calib_job, 1, 0)
        small_d, small_job = small or (None, None)
        self.fit = affine_costs(durations, self.traced, small_d,
                                compose_for(small_job, 1, 0) if small_job else None)
        self.rates = elementwise_rates(durations, self.traced)
        # clip.norm at the elements it reads, a shard's update paying its
        # type's fixed cost once: predict's pricing (scaling/model.py)
        self.reads, self.fixed = trace_prices(calib_job, durations, {0: self.traced})

    def predict(self, job, n, built=None):
        """(seconds per iteration, samples per iteration, untraced op count).
        ``built``: {rank: its composed training graph} already at hand (the
        memory plan's, ``evaluate``), read instead of composing it again."""
        from .scaling.concurrent import contended
        from .scaling.model import ITERATIONS, Scenario
        graphs, images, untraced = self.rank_graphs(job, n, built)
        # ranks sharing a node: each op at the contention of the ranks
        # computing while it runs (scaling/concurrent.py); a rank not
        # simulated computes as its place in replica 0 (Scenario.per)
        return contended(graphs, self.scale(n), n, ITERATIONS, Scenario(job, n).per).period(), \
            images, untraced

    def rank_graphs(self, job, n, built=None):
        """([RankGraph] of the simulated ranks, samples per iteration,
        untraced op count) of ``job`` at ``n`` ranks (``predict``)."""
        from .scaling.model import Scenario, Template
        scenario = Scenario(job, n)
        graphs, untraced = [], set()
        templates = [Template(job, scenario, r, (built or {}).get(r)) for r in scenario.ranks]
        # a replica of each other class (a ZeRO shard's extra updates): the
        # slowest rank ends the iteration (scaling/model.replica_classes)
        more = scenario.class_ranks({t.rank: t.graph for t in templates},
                                    self.durations.per_rank)
        templates += [Template(job, scenario, r, (built or {}).get(r)) for r in more]
        # ranks sharing a node: predict's correction at n (scaling/node.py)
        node = self.scale(n)
        overhead, per_iteration, comm_overhead = (
            (self.overhead, self.per_iteration, self.overhead) if node is None
            else node.dispatch(self.overhead, self.per_iteration, self.overhead))
        for t in templates:
            g, _, missing = t.rank_graph(_Scaled(self.durations, self.traced, t.graph, self.fit,
                                                 self.rates),
                                         self.link, self.algorithm, scenario, self.copy_cost,
                                         overhead=overhead, per_iteration=per_iteration,
                                         comm_overhead=comm_overhead, reads=self.reads,
                                         fixed=self.fixed, node=node)
            graphs.append(g)
            untraced.update(missing)
        return graphs, scenario.images, len(untraced)


def evaluate(cand, path, overrides, n, limits, predictor):
    """Fill ``cand``: its job, memory per rank and fit, predicted time; a
    refusal (UserError) becomes ``cand.error``."""
    from ..job.config import load_job
    from ..parallel.compose import layout_of
    from .graph import _OfflineWorld
    from .plan import limits_for, need_of, offline_footprints, plan_node_checks, \
        predictable_graph, ranks_to_build, set_transports
    try:
        job = load_job(path, tuple(overrides) + cand.sets, check_files=False)
        layout_of(job, _OfflineWorld(0, n))
        if job.recompute == "selective":
            why = selective_no_effect(job)
            if why is not None:
                raise UserError(f"{NO_EFFECT}: {why}")
        built, like = ranks_to_build(job, n, limits)
        graphs = {}
        by_rank = offline_footprints(job, n, built, built=graphs, limits=limits)[0]
        set_transports(by_rank, n, limits)
        fps = list(by_rank.values())
        need, lims = {}, {}
        for fp in fps:
            for where, d, lim, why in limits_for(limits, sorted(fp.devices)):
                need[where] = max(need.get(where, 0), need_of(fp, d))
                lims[where] = (int(lim), why)
            need.setdefault("host", max(f.host_total for f in fps))
        # the host per node (plan's check): the fullest node's ranks summed
        for c in plan_node_checks(by_rank, like, n, limits):
            if "node" not in need or \
                    c["need_bytes"] - c["limit_bytes"] > need["node"] - lims["node"][0]:
                need["node"], lims["node"] = c["need_bytes"], (c["limit_bytes"], c["limit_from"])
        cand.job, cand.need, cand.limits = job, need, lims
        # the prediction reads the graphs built for the memory plan where
        # they are the ones it would compose (``plan.predictable_graph``)
        ready = {r: predictable_graph(job, n, g, plans) for r, (g, plans) in graphs.items()}
        cand.iter_s, cand.samples, cand.untraced = predictor.predict(
            job, n, {r: g for r, g in ready.items() if g is not None})
    except UserError as exc:
        cand.error = str(exc).split("\n")[0]
    except SimulationStalled as exc:  # a composition whose ranks would wait for each other
        cand.error = f"its ranks would stall ({exc})"
    return cand


def samples_unit(job):
    """("tokens", per sample) for text data, else ("images", 1)."""
    train = job.data.train
    if train is not None and train.source == "text":
        return "tokens", int(train.sequence_length)
    return "images", 1


def rank(cands):
    """Possible candidates that fit first, fastest first; then those that do
    not fit (fastest first); then the possible ones left unranked
    (``Candidate.unranked``: the parameter servers, the same order among
    them); then the refused ones, in order."""
    ok = [c for c in cands if c.error is None]
    ok.sort(key=lambda c: (c.unranked is not None, not c.fits,
                           c.iter_s / max(c.samples, 1) if c.iter_s else 0.0))
    return ok + [c for c in cands if c.error is not None]


@dataclasses.dataclass
class Choice:
    """The ranked candidates and the best one (None when none fits)."""

    n: int
    ranked: list
    unit: tuple
    calibration: str
    seconds: float
    untried: int = 0  # micro-batch variants not evaluated (``variants_to_try``)
    every_count: bool = False  # ``plan --choose-all``: no variant left out
    not_tried: list = dataclasses.field(default_factory=list)  # those variants, in order
    swept: list = dataclasses.field(default_factory=list)  # plain settings with ``swept``

    @property
    def best(self):
        """The first ranked candidate where it fits; never an unranked one
        (``Candidate.unranked``: ``rank`` lists them after every ranked one)."""
        first = self.ranked[0] if self.ranked else None
        return first if first is not None and first.error is None and first.fits \
            and first.unranked is None else None

    def why(self):
        """The start-up block's line for ``scheme: auto``."""
        b = self.best
        if b is None:
            return "no setting fits"
        fit = [c for c in self.ranked if c.error is None and c.fits and c.unranked is None]
        others = len(fit) - 1
        refused = sum(1 for c in self.ranked if c.error is None and not c.fits
                      and c.unranked is None)
        return (f"{b.label}: the fastest predicted of {others + 1} setting(s) that fit "
                f"({b.iter_s:.3g} s/iter, {human_bytes(b.need.get('host', 0))} per rank"
                + (f"; {refused} did not fit" if refused else "") + ")")


def choose(path, overrides, n, limits, link=None, calibration=None, log=None,
           algorithm="auto", every_count=False):
    """The Choice for ``path`` (+ ``overrides``) on ``n`` ranks.
    ``every_count`` (``plan --choose-all``): every micro-batch count of a
    possible setting evaluated, none left out by ``variants_to_try`` (its
    ``not_tried`` empty): the check of the pruning's choice."""
    from ..graph.core import shared_dependencies
    from ..runtime.memory_plan import shared_colourings
    from ..job.config import load_job
    from .scaling.link import make_link
    t0 = time.perf_counter()
    job = load_job(path, tuple(overrides), check_files=False)
    if job.graph is not None:  # no settings to compare: before any calibration
        from ..base.errors import ConfigError
        raise ConfigError(path, "graph", "plan --choose compares the parallel and recompute "
                          "settings of a 'net:' config; a complete 'graph:' is one composition "
                          "already (its own ops and data readers): run plan on it, or "
                          "plan --choose on the config it was printed from")
    durations, small, calib_job, add = calibrate(job, path, overrides, calibration, log)
    link = link or make_link(None, None, None, gamma=add)
    if link.gamma_measured:  # timed at start-up: the calibration's, for the same figures
        link = dataclasses.replace(link, gamma=add, gamma_measured=False)
    shared = on_this_node(link, job, n, limits, calibration, log)
    if log and shared is not link:
        from .plan import node_ranks
        from .scaling.link import SHARED_MEMORY_COPIES
        k = node_ranks(limits, n)[0]
        log(f"ranks sharing a node: {k} a node; each byte a rank "
            f"sends {'to a rank of its node ' if k < n else ''}costs it "
            f"{SHARED_MEMORY_COPIES} copies at the host's "
            f"{SHARED_MEMORY_COPIES / shared.cpu / 1e9:.1f} GB/s, taken from its compute"
            f"{', one where it puts or gets (one-sided), none across nodes' if k < n else ''} "
            "(no --network file measured the link's transfer CPU)")
    link = shared
    # the settings compose the same net many times over: graphs of one
    # content share their dependencies (graph/core.shared_dependencies), and
    # memory plans of one content their colouring (runtime/memory_plan.py)
    with shared_dependencies(), shared_colourings():
        predictor = Predictor(calib_job, durations, link, algorithm, small, add,
                              getattr(limits, "ranks_per_node", None))
        cands = candidates(job, n, durations, predictor)
        variants = {}
        for c in cands:
            if c.variant_of is not None:
                variants.setdefault(id(c.variant_of), []).append(c)
        tried = set()
        for c in cands:
            if c.variant_of is not None or not c.listed:
                continue
            evaluate(c, path, overrides, n, limits, predictor)
            tried.add(id(c))
            if c.error is None and every_count:
                for v in variants.get(id(c), ()):
                    evaluate(v, path, overrides, n, limits, predictor)
                    tried.add(id(v))
            elif c.error is None:
                tried.update(id(v) for v in variants_to_try(
                    c, variants.get(id(c), ()), job.parallel.micro_batches,
                    lambda v: evaluate(v, path, overrides, n, limits, predictor)))
    listed = [c for c in cands if c.listed]
    kept = [c for c in listed if id(c) in tried]
    left = [c for c in listed if id(c) not in tried]
    return Choice(n, rank(kept), samples_unit(job), calibration or "",
                  time.perf_counter() - t0, untried=len(left), not_tried=left,
                  every_count=every_count, swept=[c for c in listed if c.swept])


def on_this_node(link, job, n, limits, cache=None, log=None):
    """``link`` with the CPU of the transfers between ranks that share a
    node (``scaling/link.shared_node``): where ``plan``'s placement
    (``plan.node_ranks``: ``--ranks-per-node``, else the launcher's count,
    else all ``n`` ranks on this node, as the memory check places them)
    puts two or more on a node, the job computes on the host (its cores
    filled by the ranks' compute) and the link's transfer CPU is not
    measured (no ``--network`` file): each byte sent to a rank of the
    sender's node (the K a node in rank order) costs the ranks
    ``SHARED_MEMORY_COPIES`` copies at the host's copy rate (``cache``'s
    ``COPY_RATE_KEY``, timed and written there when absent), a one-sided
    Put or Get one, a byte to another node none (``Link.local_ranks``:
    the collectives' share by their algorithm's partners). Before, such
    transfers took no CPU (the defaults' RDMA), and ZeRO stage 3's second
    gather of every bucket (1.5 times stage 2's bytes) came out free:
    gpt_small at 2 ranks on one 2-core node ranked first, 0.5 % ahead of
    stage 2, and measured 3 % (median of 12 interleaved rounds) behind
    stages 1 and 2 (docs/scaling.md, "Ranks sharing a node")."""
    from .plan import node_ranks
    from .scaling.link import shared_node
    k = node_ranks(limits, n)[0]
    if link.cpu_measured or k < 2 or job.device >= 0:
        return link
    return shared_node(link, k, host_copy_cost(cache, log))


def host_copy_cost(cache=None, log=None):
    """The host's copy rate (``scaling/link.copy_cost_per_byte``) kept in
    the calibration file ``cache`` (``COPY_RATE_KEY``); timed, and added to
    the file (``_keep_in_calibration``), where it is not there yet or is not
    a host rate (``host_rate``: ``log`` says so, as for a damaged file)."""
    from .scaling.link import copy_cost_per_byte
    data, _ = _calibration_json(cache)
    got = data.get(COPY_RATE_KEY) if isinstance(data, dict) else None
    if host_rate(got):
        return float(got)
    if got is not None and log:
        log(f"calibration: {cache}: {COPY_RATE_KEY} {got!r} is not a host's copy rate "
            f"(seconds per byte, above 0, at most {MAX_HOST_S_PER_BYTE:g}): timed again")
    cost = copy_cost_per_byte()
    if isinstance(data, dict):
        _keep_in_calibration(cache, COPY_RATE_KEY, cost, "copy", log)
    return cost


def shown(ranked):
    """The candidates the table shows, in ``ranked``'s order: of the
    micro-batch variants of one setting (``Candidate.variant_of``) one, the
    first that fits (the fastest), else the possible one nearest to fitting
    (the least need over its limit), else the first refused, none where
    the setting itself fits and ranks before that one (the check's count of
    ``variants_to_try``, evaluated and no faster, is not a row); every
    other candidate."""
    at = {id(c): i for i, c in enumerate(ranked)}
    groups = {}
    for c in ranked:
        if c.variant_of is not None:
            groups.setdefault(id(c.variant_of), []).append(c)
    keep = set()
    for members in groups.values():
        ok = [c for c in members if c.error is None]
        fit = [c for c in ok if c.fits]
        if fit:
            pick = fit[0]
        elif ok:
            pick = min(ok, key=_overshoot)
        else:
            pick = members[0]
        plain = pick.variant_of
        if plain.error is None and plain.fits and at.get(id(plain), len(at)) < at[id(pick)]:
            continue
        keep.add(id(pick))
    return [c for c in ranked if c.variant_of is None or id(c) in keep]


def _overshoot(c):
    """The largest ratio of ``c``'s need to its limit (a possible candidate)."""
    return max((c.need.get(w, 0) / lim for w, (lim, _) in c.limits.items() if lim > 0),
               default=0.0)


def format_choice(choice):
    unit, per = choice.unit
    rows = [("#", "setting", "memory/rank", "fits", "s/iter", f"{unit}/s")]
    table = shown(choice.ranked)
    i = 0
    for c in table:
        i += c.unranked is None or c.error is not None
        if c.error is not None:
            why = c.error if c.error.startswith(NO_EFFECT) else f"not possible: {c.error}"
            rows.append((str(i), c.label, "-", "-", "-", why))
            continue
        # "-": listed, not ranked (``Candidate.unranked``, the note below the table)
        mem = ", ".join(f"{w} {human_bytes(c.need.get(w, 0))}" for w in c.need)
        fits = "yes" if c.fits else "NO: " + ", ".join(
            f"{w} over {human_bytes(lim)} ({why})" for w, (lim, why) in c.limits.items()
            if c.need.get(w, 0) > lim)
        rate = c.samples * per / c.iter_s if c.iter_s else float("nan")
        # "*": ops the calibration's trace does not time (``untraced``)
        rows.append(("-" if c.unranked else str(i), c.label, mem, fits,
                     f"{c.iter_s:.4g}" + ("*" if c.untraced else "") +
                     ("?" if c.unranked else ""), f"{rate:,.0f}"))
    widths = [max(len(r[k]) for r in rows if len(r[k]) < 60) for k in range(5)]
    tried = len(choice.ranked)
    lines = [f"plan --choose{'-all' if choice.every_count else ''}: {choice.n} "
             f"rank{'s' if choice.n != 1 else ''}, {tried} "
             f"setting{'s' if tried != 1 else ''} tried"
             f"{' (every micro-batch count)' if choice.every_count else ''}, "
             f"{len(table)} shown, ranked by "
             f"predicted {unit}/s (calibration: {choice.calibration or 'not cached'}; "
             f"{choice.seconds:.1f} s)"]
    for r in rows:
        lines.append("  ".join(r[k].ljust(widths[k]) for k in range(5)) + "  " + r[5])
    marked = [c for c in table if c.error is None and c.untraced]
    if marked:
        lines.append(f"* ops the calibration's trace does not time, nor any traced op of "
                     f"their kind (up to {max(c.untraced for c in marked)} in "
                     f"{len(marked)} setting(s): a micro-batch's gradient sum where the trace "
                     "has no Sum, ...): a sum or copy at the host's measured add rate, any "
                     "other op 0 s (--json: untraced_ops)")
    for why in dict.fromkeys(c.unranked for c in table if c.error is None and c.unranked):
        lines.append(f"? not ranked, never chosen by parallel.scheme auto: {why}")
    if tried > len(table):
        lines.append(f"({tried - len(table)} setting(s) at other micro-batch counts not "
                     "shown: of each data or sharded setting's counts (parallel.micro_batches) "
                     "the table shows the first that fits, else the nearest to fitting; "
                     "--json lists every one)")
    for c in choice.swept:
        lines.append(f"(check: {c.label}: {c.swept})")
    if choice.untried:
        lines.append(f"({choice.untried} setting(s) at other micro-batch counts not tried: "
                     f"{not_tried_words(choice.not_tried)}; --json: not_tried)")
    b = choice.best
    if b is None:
        lines.append("no setting fits: give the ranks more memory, or more ranks")
    else:
        lines.append(f"best: {b.set_line()}")
        if b.untraced:
            lines.append(f"note: {b.untraced} op(s) of the best setting were not in the "
                         "calibration's trace: a sum or copy at the host's measured add "
                         "rate, any other op 0 s")
    return "\n".join(lines)


def not_tried_words(left):
    """How many of the variants ``left`` out were left out for each reason
    (``NOT_TRIED``'s order), in words."""
    counts = {}
    for c in left:
        counts[c.not_tried] = counts.get(c.not_tried, 0) + 1
    return "; ".join(f"{counts[k]} as {NOT_TRIED.get(k, k)}" for k in
                     list(NOT_TRIED) + sorted(set(counts) - set(NOT_TRIED), key=str)
                     if k in counts)


def choice_json(choice):
    """``plan --choose --json``: {"np", "unit", "calibration", "candidates":
    [{"label", "set", "error" | "need_bytes", "limit_bytes", "fits", "iter_s",
    "samples_per_s", "untraced_ops", "ranked", "note" where not ranked}],
    "not_tried": [{"label", "set",
    "micro_batches", "variant_of", "reason", "why"}], "swept": [{"label", "why"}],
    "best": the best's --set
    options or null} (``untraced_ops``: the setting's ops not in the
    calibration's trace; ``not_tried``: the micro-batch counts
    ``variants_to_try`` left out, ``reason`` a ``NOT_TRIED`` key, ``why``
    its words, ``variant_of`` the label of the setting they are counts of;
    ``swept``: the settings whose every count was evaluated, the check of
    ``variants_to_try`` having found a larger count predicted faster)."""
    unit, per = choice.unit
    rows = []
    for c in choice.ranked:
        row = {"label": c.label, "set": list(c.sets)}
        if c.error is not None:
            row["error"] = c.error
        else:
            row.update(need_bytes=c.need, limit_bytes={w: lim for w, (lim, _) in
                                                       c.limits.items()},
                       fits=c.fits, iter_s=c.iter_s,
                       samples_per_s=c.samples * per / c.iter_s if c.iter_s else None,
                       untraced_ops=c.untraced, ranked=c.unranked is None)
            if c.unranked is not None:
                row["note"] = c.unranked
        rows.append(row)
    left = [{"label": c.label, "set": list(c.sets), "micro_batches": c.micro,
             "variant_of": c.variant_of.label if c.variant_of is not None else None,
             "reason": c.not_tried, "why": NOT_TRIED.get(c.not_tried, c.not_tried)}
            for c in choice.not_tried]
    return {"np": choice.n, "unit": unit, "calibration": choice.calibration,
            "candidates": rows, "not_tried": left,
            "swept": [{"label": c.label, "why": c.swept} for c in choice.swept],
            "best": list(choice.best.sets) if choice.best else None}


def best_yaml(choice):
    """The job with the best setting, as YAML (``--out``): it loads and
    trains as it is; its first lines say the setting as --set options."""
    from ..job.config import dump_config
    b = choice.best
    return (f"# plan --choose on {choice.n} ranks: {b.label}; predicted {b.iter_s:.4g} s/iter\n"
            f"# the same as the job with: {b.set_line()}\n" + dump_config(b.job))


def default_calibration(job):
    """The cache of ``plan --choose`` without --calibration: beside the job's runs."""
    base = job.checkpoint.folder or os.path.join("runs", job.name)
    return os.path.join(base, "calibration.json")
