"""How many BLAS/OpenMP threads one rank uses, decided once for every entry
point (``python -m purine_mpi``, the ``purine-mpi`` script, ``import
purine_mpi``), before NumPy loads its BLAS.

Several ranks on one node must not each start a BLAS pool of every core:
oversubscribed, they all crawl (a 2-rank job ran 7x slower through the
script than through ``python -m`` when only one of them limited its
threads). The default is the cores this rank may run on (its CPU affinity
mask: SLURM's ``--cpus-per-task``, ``taskset``, a cgroup) divided among the
ranks of this host, and at least 1. ``PURINE_THREADS`` overrides it; so does
``OMP_NUM_THREADS`` when the user set it. The decision is exported as
``OMP_NUM_THREADS`` (a variable the user set keeps its value) and reported
in the start-up block as ``threads N per rank (why)``; those are the threads
of the host products (``ops/hostgemm.py``), which cut each product by its
shapes only. BLAS itself runs one thread (``OPENBLAS_NUM_THREADS`` and
``MKL_NUM_THREADS`` are exported as 1, unless the user set them): OpenBLAS's
threads split a GEMM where the thread count says, and its results then
depend on that count, while ours are the same bits at any count
(docs/running.md, "Reproducibility").

Cores that other processes keep busy are not this job's: 2 threads on 2
cores beside one busy process ran 1.7-18x slower than 1 thread (issue 36).
The busy cores are measured by sampling ``/proc/stat`` over the cores of the
affinity mask for ``LOAD_SAMPLE_S`` (``os.getloadavg()`` where there is no
``/proc``), less this process's own use and one core for each other rank of
the job on this host (``busy_elsewhere``). By default the threads are then
the free cores over the ranks; with a count the user chose, the start-up
block says when the job's threads exceed the free cores and names
``PURINE_THREADS=1``. The reason adds up: ``2 usable cores - 1 busy with
other processes (1.2 measured) = 1 free``. A host that runs more ranks than
it has usable cores gets a warning in the same line (rank 0's start-up
block: once).

Imports nothing but the standard library: it must run before NumPy.
"""
import os
import sys

from . import env

#: variables that limit the BLAS and OpenMP pools
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: the BLAS pools, held to one thread: the rank's threads are hostgemm's
BLAS_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
#: how launchers tell a rank how many ranks share its host
LOCAL_SIZE_VARS = ("PURINE_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "PMI_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

#: (threads, why) as decided at import
DECISION = None
#: whether BLAS runs one thread (decided at import with ``DECISION``): every
#: BLAS variable is 1 and NumPy loaded its BLAS after they were set. Else a
#: product's work is spread over BLAS's own threads, which the calling
#: thread's CPU time does not count (runtime/executors.py, ``args.cpu_us``)
BLAS_ONE = None
#: the cores busy with other processes' work, when measured (at import for
#: the default count, else at the start-up block)
BUSY = None
#: seconds over which /proc/stat is sampled
LOAD_SAMPLE_S = 0.1
#: busy cores below this are noise (a shell, a monitor), not a competitor
BUSY_MIN = 0.5
#: the thread variables the user had set before purine_mpi was imported
_set_before = {v for v in THREAD_VARS if v in os.environ}


def _positive(value):
    try:
        number = int(str(value).strip().split("(")[0])
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def usable_cores():
    """The cores this process may run on (its affinity mask), else the count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ranks_on_this_host(environ=os.environ):
    """(ranks sharing this host, the variable that said so), else (1, None)."""
    for var in LOCAL_SIZE_VARS:
        n = _positive(environ.get(var))
        if n is not None:
            return n, var
    return 1, None


def _cpu_times(cpus):
    """(busy, total) jiffies of the cores ``cpus`` from /proc/stat."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(values)
            busy += sum(values) - values[3] - values[4]
    return busy, total


def _own_cpu():
    """This process's CPU seconds (user and system, every thread)."""
    return sum(os.times()[:2])


def busy_elsewhere(ranks=1, seconds=None):
    """Cores of this process's affinity mask kept busy by other processes
    than this job's ranks: /proc/stat sampled over ``seconds``, less this
    process's own CPU time and one core per other rank of the job on this
    host (they start alongside it); the 1-minute load average less the
    job's ranks where there is no /proc/stat. None when neither can be read."""
    import time
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = set(range(os.cpu_count() or 1))
    try:
        busy0, total0 = _cpu_times(cpus)
        own0, wall0 = _own_cpu(), time.monotonic()
        time.sleep(LOAD_SAMPLE_S if seconds is None else seconds)
        busy1, total1 = _cpu_times(cpus)
        own1, wall1 = _own_cpu(), time.monotonic()
        if total1 <= total0:
            raise OSError("no ticks")
        busy = len(cpus) * (busy1 - busy0) / (total1 - total0)
        busy -= (own1 - own0) / max(wall1 - wall0, 1e-6)
    except (OSError, ValueError):
        try:
            busy = os.getloadavg()[0] - 1
        except (AttributeError, OSError):
            return None
    return max(0.0, busy - (ranks - 1))


def decide(environ=os.environ, cores=None, busy=None):
    """(threads per rank, why) from the environment (see the module
    docstring); ``busy``: the cores other processes keep busy (measured by
    ``apply``), None for none."""
    own = env.get("PURINE_THREADS", environ)  # EnvError (a ValueError) when not one
    if own is not None:
        return own, "PURINE_THREADS"
    user = _positive(environ.get("OMP_NUM_THREADS"))
    if user is not None:
        return user, "OMP_NUM_THREADS"
    cores = usable_cores() if cores is None else cores
    ranks, var = ranks_on_this_host(environ)
    why = f"{cores} usable core{'s' if cores != 1 else ''}"
    free = cores
    if busy is not None and busy >= BUSY_MIN:
        taken = min(cores, round(busy))
        free = cores - taken
        why += f" - {taken} busy with other processes ({busy:.1f} measured) = {free} free"
    if var is not None:
        why += f" / {ranks} rank{'s' if ranks != 1 else ''} on this host ({var})"
    threads = free // ranks
    if threads < 1:
        threads = 1
        why += "; 1 is the least"
    return threads, why


def automatic(environ=os.environ):
    """Whether the count is ours to choose (neither PURINE_THREADS nor the
    user's OMP_NUM_THREADS set)."""
    return "PURINE_THREADS" not in environ and _positive(environ.get("OMP_NUM_THREADS")) is None


def most(environ=os.environ, local_ranks=None):
    """The most threads a run started here with this environment may use:
    the user's count (``PURINE_THREADS``, an ``OMP_NUM_THREADS`` set before
    purine_mpi was imported) when set, else the usable cores over this
    host's ranks without the load (``decide`` with none busy: a busy core
    only lowers the count ``apply`` picks at start-up). What ``plan``
    counts the host products' per-thread scratch for (ops/hostgemm.py's
    ``planned_threads``): the count a run will pick depends on the load at
    its own start-up, not known before. ``local_ranks``: the ranks that
    will share this host (``plan --np N`` outside mpiexec, where no
    launcher says so: tools/plan.host_ranks), as the launcher's variable
    would say in the run (``PURINE_LOCAL_SIZE``); None: the environment's."""
    mine = dict(environ)
    if "OMP_NUM_THREADS" not in _set_before:   # ours (``apply`` exported it), not the user's
        mine.pop("OMP_NUM_THREADS", None)
    if local_ranks is not None:
        mine["PURINE_LOCAL_SIZE"] = str(max(1, int(local_ranks)))
    try:
        return decide(mine)[0]
    except ValueError:
        return 1


def apply(environ=os.environ):
    """Decide and export the thread count (once per process); returns
    (threads, why). Called by ``purine_mpi/__init__.py``."""
    global DECISION, BUSY, BLAS_ONE
    if DECISION is not None:
        return DECISION
    try:
        if automatic(environ):  # only then does the load change the count
            BUSY = busy_elsewhere(ranks_on_this_host(environ)[0])
        threads, why = decide(environ, busy=BUSY)
    except ValueError as exc:
        threads, why = 1, f"{exc}; using 1"
    for var in THREAD_VARS:
        environ.setdefault(var, "1" if var in BLAS_VARS else str(threads))
    numpy_first = "numpy" in sys.modules and not _set_before.issuperset(BLAS_VARS)
    if numpy_first:
        why += "; NumPy was loaded first, so its BLAS may use other counts"
    BLAS_ONE = not numpy_first and all(environ.get(v) == "1" for v in BLAS_VARS)
    blas = [f"{v}={environ[v]}" for v in BLAS_VARS if v in _set_before and environ[v] != "1"]
    if blas:
        why += (f"; {' '.join(blas)} set: BLAS's own threads make the results depend on "
                "the thread count")
    DECISION = (threads, why)
    return DECISION


def busy_note(threads, ranks, cores, busy):
    """The start-up block's warning when this host's ranks run more threads
    than the cores other processes leave free, else None."""
    if busy is None or busy < BUSY_MIN or threads <= 1:
        return None  # one thread per rank is all that can be given up
    free = cores - busy
    if threads * ranks <= max(1.0, free) + 0.25:
        return None
    return (f"the cores are shared: {busy:.1f} of {cores} busy with other processes, "
            f"{threads * ranks} thread{'s' if threads * ranks != 1 else ''} of this job on "
            f"this host; PURINE_THREADS=1 may run faster")


def describe(environ=os.environ):
    """The start-up block's line: ``N per rank (why)``, and the busy-cores
    warning (``busy_note``; the load measured now for a count the user chose)."""
    global BUSY
    threads, why = DECISION or apply(environ)
    ranks = ranks_on_this_host(environ)[0]
    if BUSY is None and threads > 1 and not automatic(environ):
        # one thread per rank has nothing to give up (busy_note): no 0.1 s sample
        BUSY = busy_elsewhere(ranks)
    cores = usable_cores()
    notes = [n for n in (busy_note(threads, ranks, cores, BUSY), oversubscribed(ranks, cores))
             if n]
    return f"{threads} per rank ({why})" + "".join(f"; {n}" for n in notes)


def oversubscribed(ranks, cores):
    """The start-up block's warning when this host runs more ranks than it
    has usable cores (``mpiexec -n 3`` on 2 cores), else None."""
    if ranks <= cores:
        return None
    return (f"warning: {ranks} ranks on this host, which has {cores} usable "
            f"core{'s' if cores != 1 else ''}: the ranks take turns on them, each runs slower "
            "than alone (fewer ranks per host, or more hosts)")
