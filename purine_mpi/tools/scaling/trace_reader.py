"""Reading a run's traces for the scaling predictor.

A trace folder holds the ``trace.rank<R>.json`` files of one run (``train
--profile`` / ``--profile-iters A:B``, docs/formats.md "Traces") and the
run's ``config.yaml``. ``read_traces`` returns each rank's per-op median
duration over the traced iterations (an op that runs several times in one
iteration counts its sum), the traced iteration time, and the job. The
traces of a parameter-server run are refused (``refuse_server_run``).
"""
import glob
import json
import math
import os
import re
import statistics
from collections import defaultdict

from ...base.errors import UserError
from ...runtime.trace import SERVER_ROLE

_RANK = re.compile(r"trace\.rank(\d+)\.json$")
# an op on a ZeRO shard of a gradient: ``<param>.grad.shard[a:b]`` then the
# op's own suffix (``.clip``, loss scaling's ``.unscale``, ``@unscale.clip``),
# which names no parameter ('/', '[' or ']'): a layer named ``c.shard[0:4].x``
# has ops ``c.shard[0:4].x/weight.update[0:112]``, on no shard of ``c``
_SHARD = re.compile(r"(.+\.grad)\.shard\[(\d+):(\d+)\]([.@][^/\[\]]+)")


class Durations:
    """{rank: {op name: median seconds}} and the lookup the model uses."""

    def __init__(self, per_rank, iter_seconds=None, iterations=0, gaps=None, fastest=None,
                 replayed=()):
        self.per_rank = per_rank
        self.iter_seconds = iter_seconds or {}
        self.iterations = iterations
        #: {rank: seconds the busiest thread idled between two of its ops
        #: inside an iteration, per op} (``dispatch_gap``); empty where not
        #: measured (a constructed trace, a calibration file of an older format)
        self.gaps = gaps or {}
        #: {rank: {op name: its least seconds in one traced iteration}}
        #: (``op_minima``): the op's time least disturbed by other work on
        #: the machine, which the fit of its cost per call reads
        #: (tools/choose.affine_costs); empty where not measured
        self.fastest = fastest or {}
        #: the ops that ran only inside CUDA graph replays, timed as a whole
        #: (``replayed_ops``, which ``read_traces`` gives)
        self.replayed = set(replayed)
        #: {rank: the trace's load factor} where its op times were read as
        #: CPU time (``read_traces(cpu=True)``: ``load_factor``), else empty
        self.load = {}
        self._rows = {}  # base name -> total rows of its [a:b] chunks
        # base name -> the names of its chunks on any rank: ``lookup`` asks
        # for every op of every candidate's graph (a name matched against
        # each traced name: 5% of ``plan --choose`` on gpt_small)
        self._chunks = defaultdict(set)
        # (gradient, suffix) -> [(rank, seconds, elements)] of the traced
        # ops on a ZeRO shard of it (``w.grad.shard[a:b].clip``: split_shard)
        self._shards = defaultdict(list)
        # base name -> [(rank, seconds, rows)] of its traced [a:b] chunks
        self._chunk_rows = defaultdict(list)
        for r, ops in per_rank.items():
            for name in ops:
                base, a, b = split_chunk(name)
                if base is not None:
                    self._rows[base] = max(self._rows.get(base, 0), b)
                    self._chunks[base].add(name)
                    if b > a:
                        self._chunk_rows[base].append((r, ops[name], b - a))
                shard = split_shard(name)
                if shard is not None and shard[2] > shard[1]:
                    grad, a, b, suffix = shard
                    self._shards[grad, suffix].append((r, ops[name], b - a))
                    self._chunks[grad + suffix].add(name)

    def lookup(self, name, rank=0, rows=None, fixed=0.0):
        """Seconds of op ``name`` on ``rank``: that rank's median, else the
        median over the ranks that ran it; None when no rank traced it.
        A row chunk ``op[a:b]`` of an op traced whole takes its share of the
        rows (``rows``: how many the whole op has); a whole op traced as
        chunks, their sum. An op on a ZeRO shard of a gradient the trace
        does not name (``w.grad.shard[a:b].clip``: the bounds change with
        the rank count) takes its elements' share of the traced ops on
        shards of the same gradient (``rank``'s own, else every rank's),
        else of the op on the whole gradient (``w.grad.clip``, ``rows``:
        the gradient's elements), a bytes-bound op; a row chunk traced
        neither whole nor under its name (a shard's update ``w.update[a:b]``
        at another rank count), its rows' share of the traced chunks of the
        op; the op on a whole gradient traced as shards, their sum.
        ``fixed``: the op's fixed cost per call (``model.fixed_costs``),
        which a share does not divide: a chunk or shard then takes
        ``fixed`` plus its share of the rest of the traced time (of each
        traced chunk's), a whole op traced as k chunks their sum less
        (k - 1) ``fixed``."""
        found = self._exact(name, rank)
        if found is not None:
            return found
        shard = split_shard(name)
        if shard is not None:
            return self._shard_share(rank, rows, *shard, fixed=fixed)
        base, a, b = split_chunk(name)
        if base is not None:
            whole = self._exact(base, rank)
            rows = self._rows.get(base) or rows
            if whole is not None and rows:
                f = min(fixed, whole)
                return f + (whole - f) * (b - a) / rows
            # traced as other chunks (a ZeRO shard's update ``w.update[a:b]``,
            # its bounds set by the rank count): their rows' rate
            return _share(self._chunk_rows.get(base, ()), rank, b - a, fixed)
        parts = [self._exact(n, rank) for n in self._chunks_of(name)]
        if parts and all(p is not None for p in parts):
            return sum(parts) - (len(parts) - 1) * min([fixed] + parts)
        return None

    def _shard_share(self, rank, rows, grad, a, b, suffix, fixed=0.0):
        found = _share(self._shards.get((grad, suffix), ()), rank, b - a, fixed)
        if found is not None:
            return found
        whole = grad + suffix
        seconds = self._exact(whole, rank)
        if seconds is None and sum_alias(whole):
            seconds = self._exact(sum_alias(whole), rank)
        if seconds is not None and rows:
            f = min(fixed, seconds)
            return f + (seconds - f) * (b - a) / rows
        return None

    def least_rank(self, name):
        """The least of the ranks' medians of op ``name`` (None when no rank
        traced it): a collective's time on the rank that posted it last, the
        others' medians holding their wait for that rank as well
        (model.dispatch_overhead simulates every class of ranks, the slowest
        one's compute making the wait)."""
        found = [ops[name] for ops in self.per_rank.values() if name in ops]
        return min(found) if found else self.lookup(name)

    def least(self, name, rank=0):
        """The least seconds of op ``name`` in one traced iteration of
        ``rank`` (``fastest``), else its median (``lookup``)."""
        found = self.fastest.get(rank, {}).get(name)
        return found if found is not None else self.lookup(name, rank)

    def _exact(self, name, rank):
        mine = self.per_rank.get(rank, {})
        if name in mine:
            return mine[name]
        others = [ops[name] for ops in self.per_rank.values() if name in ops]
        return statistics.median(others) if others else None

    def _chunks_of(self, name):
        return sorted(self._chunks.get(name, ()))


def _share(traced, rank, count, fixed=0.0):
    """Seconds of ``count`` rows or elements at the rate of ``traced``
    [(rank, seconds, rows)]: ``rank``'s own entries, else every rank's;
    None when there are none. ``fixed``: each call's fixed cost, paid once
    by the op priced and left out of the traced entries' rate."""
    use = [t for t in traced if t[0] == rank] or traced
    if not use:
        return None
    f = min([fixed] + [t[1] for t in use])
    return f + sum(t[1] - f for t in use) * count / sum(t[2] for t in use)


def sum_alias(name):
    """The name the same op on a gradient has at another rank count: on
    several ranks an op on a parameter's gradient (gradient clipping's
    ``w.grad.clip``) reads the summed gradient and is named
    ``w.grad.sum.clip``; on one rank it reads ``w.grad``. Either name for
    the other (None when ``name`` is on no gradient): a trace of one rank
    count prices these ops at another, rather than count them as 0 s
    (a 2-rank prediction from a 1-rank trace above 100 % efficiency)."""
    if ".grad.sum." in name:
        return name.replace(".grad.sum.", ".grad.", 1)
    if ".grad." in name:
        return name.replace(".grad.", ".grad.sum.", 1)
    return None


def split_chunk(name):
    """``"ip1/weight.update[0:512]"`` -> ("ip1/weight.update", 0, 512);
    (None, None, None) for a name without a row range."""
    m = re.fullmatch(r"(.*)\[(\d+):(\d+)\]", name)
    if not m:
        return None, None, None
    return m.group(1), int(m.group(2)), int(m.group(3))


def split_shard(name):
    """``"w.grad.shard[0:112].clip"`` -> ("w.grad", 0, 112, ".clip"): an op
    on elements a:b of a ZeRO shard (parallel/sharding.py names a shard
    ``<blob>.shard[a:b]``), its bounds set by the rank count; None for any
    other name (a name ending in the bounds is a row chunk: split_chunk)."""
    m = _SHARD.fullmatch(name)
    if not m:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)


def shard_rows_key(name):
    """The name whose element count ``Durations.lookup``'s ``rows`` gives
    for op ``name``: a row chunk's whole op (split_chunk), a shard op's op
    on the whole gradient (split_shard: ``w.grad.clip``); None otherwise."""
    base, _, _ = split_chunk(name)
    if base is not None:
        return base
    shard = split_shard(name)
    return None if shard is None else shard[0] + shard[3]


def trace_files(folder):
    """{rank: path} of the folder's ``trace.rank<R>.json``; a UserError when
    there are none."""
    if not os.path.isdir(folder):
        raise UserError(f"predict {folder}: not a folder (give the run folder that holds "
                        "trace.rank<R>.json, written by train --profile-iters A:B)")
    files = {}
    for path in glob.glob(os.path.join(folder, "trace.rank*.json")):
        m = _RANK.search(os.path.basename(path))
        if m:
            files[int(m.group(1))] = path
    if not files:
        raise UserError(f"predict {folder}: no trace.rank<R>.json there (write them with "
                        "train --profile-iters A:B --out FOLDER)")
    return dict(sorted(files.items()))


def load_events(path):
    """The op events (``"ph": "X"``) of one trace file; a file of a killed
    run lacks the closing ``]}`` and is read without it."""
    return load_trace(path)[0]


def load_trace(path):
    """(the op events, whether it is a parameter server's trace: a
    ``process_labels`` metadata event naming runtime/trace.SERVER_ROLE)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise UserError(f"predict: {path} is not a Chrome trace (not UTF-8 text: byte "
                        f"{exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise UserError(f"predict: cannot read {path} ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = json.loads(text.rstrip().rstrip(",") + "\n]}")
        except ValueError as exc:
            raise UserError(f"predict: {path} is not a Chrome trace ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise UserError(f"predict: {path} has no traceEvents list")
    ops = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    for i, e in enumerate(ops):
        _check_event(path, i, e)
    server = any(isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_labels"
                 and isinstance(e.get("args"), dict) and e["args"].get("labels") == SERVER_ROLE
                 for e in events)
    return ops, server


def _is_time(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_event(path, i, e):
    """A UserError naming the file and the op event unless ``e`` has what
    the predictor reads: a string ``name``, finite numbers ``ts`` and
    ``dur`` >= 0 (microseconds) and, where given, an integer ``args.iter``
    (a NaN duration would never let the simulated iteration end)."""
    args = e.get("args")
    it = args.get("iter") if isinstance(args, dict) else None
    bad = ("a string 'name'" if not isinstance(e.get("name"), str) else
           "a finite number 'ts'" if not _is_time(e.get("ts")) else
           "a finite number 'dur' >= 0" if not (_is_time(e.get("dur")) and e["dur"] >= 0) else
           "an 'args' object" if args is not None and not isinstance(args, dict) else
           "an integer 'args.iter'" if it is not None and (isinstance(it, bool)
                                                          or not isinstance(it, int)) else
           None)
    if bad:
        shown = json.dumps(e)
        shown = shown if len(shown) <= 160 else shown[:160] + "..."
        raise UserError(f"predict: {path}: op event {i} (\"ph\": \"X\") lacks {bad}: "
                        f"{shown}")


def _per_iteration(events, skip_first):
    """({op name: {iteration: seconds}} of the op events, {iteration: its
    first event's start in seconds}, the iterations read: the first traced
    one left out when there are three or more, as it may start mid-way)."""
    per = defaultdict(lambda: defaultdict(float))
    starts = defaultdict(lambda: float("inf"))
    for e in events:
        it = (e.get("args") or {}).get("iter")
        if it is None:
            continue
        per[e["name"]][it] += e["dur"] * 1e-6
        starts[it] = min(starts[it], e["ts"] * 1e-6)
    iters = sorted(starts)
    if skip_first and len(iters) >= 3:
        iters = iters[1:]
    return per, starts, iters


def median_durations(events, skip_first=True, grouped=None):
    """({op name: median seconds per iteration}, traced iteration seconds or
    None, number of iterations used). The first traced iteration is left
    out when there are three or more (it may start mid-way). ``grouped``:
    ``_per_iteration(events, skip_first)`` where the caller has it."""
    per, starts, iters = grouped or _per_iteration(events, skip_first)
    medians = {name: statistics.median([by_it.get(i, 0.0) for i in iters]) if iters else 0.0
               for name, by_it in per.items()}
    gaps = [starts[b] - starts[a] for a, b in zip(iters, iters[1:]) if b == a + 1]
    return medians, (statistics.median(gaps) if gaps else None), len(iters)


def op_minima(events, skip_first=True, grouped=None):
    """{op name: its least seconds in one iteration} over the iterations
    ``median_durations`` reads (an op that runs several times in one
    iteration counts its sum there); ``grouped`` as ``median_durations``'."""
    per, _, iters = grouped or _per_iteration(events, skip_first)
    return {name: min(by_it.get(i, 0.0) for i in iters) for name, by_it in per.items()
            if iters}


def dispatch_gap(events, skip_first=True):
    """Seconds per op the busiest thread (the ``tid`` with the most op
    events) was idle between the end of one of its ops and the start of its
    next one inside the same iteration: the dispatcher's own cost per op
    (finding the next ready op, waking its worker), medians over the
    iterations ``median_durations`` reads; None without two ops in one
    iteration. The time between iterations (the trainer's loop) is not in
    it: a cost per iteration, not per op (scaling/model.dispatch_overhead)."""
    per = defaultdict(lambda: defaultdict(list))
    counts = defaultdict(int)
    for e in events:
        it = (e.get("args") or {}).get("iter")
        if it is None:
            continue
        per[it][e.get("tid")].append((e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6))
        counts[e.get("tid")] += 1
    if not counts:
        return None
    busiest = max(counts, key=lambda t: (counts[t], str(t)))
    iters = sorted(per)
    if skip_first and len(iters) >= 3:
        iters = iters[1:]
    gaps = []
    for it in iters:
        spans = sorted(per[it].get(busiest, ()))
        if len(spans) < 2:
            continue
        idle, end = 0.0, spans[0][1]
        for a, b in spans[1:]:
            idle += max(0.0, a - end)
            end = max(end, b)
        gaps.append(idle / (len(spans) - 1))
    return statistics.median(gaps) if gaps else None


#: the categories of the events that wait on other ranks or the network
#: (their wall time is the op's time, not CPU time: ``cpu_time``)
WAITING_CATEGORIES = ("comm", "rma", "staging")
#: the categories of the host ops that wait for another thread of the rank
#: (``io``: the data op, ops/data.py ``_take``, waits for the batch its
#: prefetch thread reads): the op's thread's CPU time is not the op's cost,
#: and its wait no core taken by other processes. Left out of
#: ``load_factor``; priced at their wall time over it (``cpu_time``)
THREAD_WAIT_CATEGORIES = ("io",)


def on_device(event):
    """Whether a trace event is a device's (a CUDA stream's row
    ``gpu<d>:<stream>``, a graph replay's ``gpu<d>:graph``, a copy stream's
    ``h2d``/``d2h``, or a further row ``<tid>.<k>`` of one: runtime/trace.py),
    timed by CUDA events, with no CPU time of its own."""
    tid = str(event.get("tid", "")).split(".")[0]
    return tid.startswith("gpu") or tid in ("h2d", "d2h")


def load_factor(events):
    """The wall time over the CPU time of the host ops of ``events`` that
    carry ``args.cpu_us`` (runtime/executors.py: the op's thread's CPU time,
    recorded where each op runs on one thread): how much longer than its own
    work an op took because its thread waited for a core (other processes,
    other ranks on the same cores); at least 1. None where no such op is
    there (an older trace, host products on several threads) and for a GPU
    run's trace (any event ``on_device``): its host ops' waits for a core
    say nothing of the device's times nor of an iteration they pace."""
    if any(on_device(e) for e in events):
        return None
    wall = cpu = 0.0
    for e in events:
        c = (e.get("args") or {}).get("cpu_us")
        if e.get("cat") in WAITING_CATEGORIES + THREAD_WAIT_CATEGORIES or not _is_time(c) \
                or c < 0:
            continue
        wall += e["dur"]
        cpu += c
    return max(1.0, wall / cpu) if cpu > 0 else None


def cpu_time(events, factor):
    """``events`` with each host op's ``dur`` its CPU time (``args.cpu_us``),
    one without it (or that waits for another thread of the rank:
    ``THREAD_WAIT_CATEGORIES``) its wall time over ``factor``
    (``load_factor``); the waiting events (``WAITING_CATEGORIES``) as they are: the op times of an
    undisturbed run, whatever else ran on the machine at the time."""
    out = []
    for e in events:
        if e.get("cat") not in WAITING_CATEGORIES:
            c = (e.get("args") or {}).get("cpu_us")
            own = _is_time(c) and c >= 0 and e.get("cat") not in THREAD_WAIT_CATEGORIES
            e = dict(e, dur=min(e["dur"], c) if own else e["dur"] / factor)
        out.append(e)
    return out


def read_traces(folder, cpu=False):
    """(Durations, job) of a trace folder (the job of its config.yaml,
    job/job.py); a UserError when the folder lacks the traces or the run's
    config.yaml, or when the run was traced under parameter servers
    (``refuse_server_run``). ``cpu``: where a rank's trace records its ops'
    CPU time (``load_factor``), the ops take it (``cpu_time``), and the
    traced iteration and the dispatcher's gaps (``dispatch_gap``: the
    dispatcher thread's own work, slowed alike) their wall time over the
    load factor (``Durations.load``): the times the rank would take with
    its cores to itself (``plan --choose``'s calibration, tools/choose.py:
    the one-rank trace priced every setting at the load of the moment it
    ran, which differed from the load each setting then met)."""
    from ...job.config import load_job
    files = trace_files(folder)
    per_rank, iter_s, counts, gaps, fastest, replayed = {}, {}, [], {}, {}, set()
    servers, load = [], {}
    for rank, path in files.items():
        events, server = load_trace(path)
        if server:  # a parameter server's graph: not a replica of the net
            servers.append(rank)
            continue
        factor = load_factor(events) if cpu else None
        gap = dispatch_gap(events)
        if factor is not None:
            load[rank] = factor
            events = cpu_time(events, factor)
        grouped = _per_iteration(events, True)   # grouped once for both readers
        medians, period, n = median_durations(events, grouped=grouped)
        if factor is not None:
            # the iteration from the first events' starts: wall time
            period = None if period is None else period / factor
            gap = None if gap is None else gap / factor
        fastest[rank] = op_minima(events, grouped=grouped)
        if gap is not None:
            gaps[rank] = gap
        if not medians:
            raise UserError(f"predict: {path} holds no op events (was the traced window "
                            "--profile-iters A:B inside the run?)")
        per_rank[rank], iter_s[rank] = medians, period
        counts.append(n)
        replayed |= replayed_ops(events)
    cfg_path = os.path.join(folder, "config.yaml")
    if servers:  # refused before the config is read: a server's label is enough
        refuse_server_run(folder, None, servers, cfg_path)
    if not os.path.isfile(cfg_path):
        raise UserError(f"predict {folder}: no config.yaml there (the run folder of train "
                        "--profile-iters holds one; the predictor rebuilds the graph from it)")
    job = load_job(cfg_path, check_files=False)
    if job.parallel.servers:  # an async run's servers, or an older version's, write no label
        refuse_server_run(folder, job, servers, cfg_path)
    d = Durations(per_rank, iter_s, min(counts), gaps, fastest, replayed)
    d.load = load
    return d, job


def refuse_server_run(folder, job, servers, cfg_path):
    """The UserError (exit 2) for a run traced under parameter servers
    (``parallel.mode`` sync_ps or async): the scaling model prices replicas
    of the net, not a server's waits, and its parameter-server terms are not
    validated against measurement (tools/choose.PS_NOT_VALIDATED), so a
    prediction from such a trace would be a wrong figure shown as a good one
    (before: the servers left out, a 3-rank sync_ps run priced as a run of
    its 2 workers, 0 µs of dispatch found: docs/scaling.md, "Parameter
    servers"). ``job``: the run's saved
    config (None when a trace's ``process_labels`` told it first: the config
    is then read where it can be); ``servers``: the ranks whose trace is
    marked a parameter server's (none in an async run, whose servers write
    no trace, or in a trace of an older version: the saved config's mode
    tells)."""
    if job is None and os.path.isfile(cfg_path):
        from ...job.config import load_job
        try:
            job = load_job(cfg_path, check_files=False)
        except UserError:  # the label alone refuses the run
            job = None
    what = []
    if job is not None and job.parallel.servers:
        what.append(f"parallel.mode: {job.parallel.mode}, parallel.ps_ranks "
                    f"{job.parallel.ps_ranks} in its config.yaml")
    if servers:
        what.append(", ".join(f"trace.rank{r}.json" for r in servers)
                    + (" is a server's" if len(servers) == 1 else " are servers'"))
    raise UserError(f"predict {folder}: the run was traced under parameter servers "
                    f"({'; '.join(what)}), which the scaling model does not price (its "
                    "parameter-server terms are not validated against measurement: "
                    "docs/scaling.md, \"Parameter servers\"); to price data parallelism, "
                    "trace the same job under parallel.mode: sync (train JOB.yaml --set "
                    "parallel.mode=sync --profile-iters A:B --out FOLDER)")


def replayed_ops(events):
    """The names of the ops that ran inside the CUDA graph replays of
    ``events`` (a ``CudaGraph`` event's ``args.ops``, runtime/cuda_graph.py:
    on a GPU with ``cuda_graph: true``, the default, the trace times each
    replay, not its ops)."""
    out = set()
    for e in events:
        args = e.get("args")
        if isinstance(args, dict) and args.get("op_type") == "CudaGraph" and \
                isinstance(args.get("ops"), list):
            out.update(n for n in args["ops"] if isinstance(n, str))
    return out
