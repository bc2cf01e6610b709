"""``mpiexec -n 2 python -m purine_mpi predict --calibrate LINK.json``:
measure the link the ranks run on, for ``predict --link LINK.json``.

- α and β: a ping-pong between ranks 0 and 1 (half the median round trip
  of each size, as osu_latency): α is the time of an 8-byte message, β the
  slope between 1 MiB and 4 MiB.
- α_put and β_put: the same ping-pong one-sided, beside it: ``MPI_Put``
  into the peer's ``Win.Allocate`` window (one ``Lock_all`` epoch for the
  whole sweep), ``Win_flush``, then a notify word raised by
  ``MPI_Accumulate`` and flushed; the receiver polls its word. What
  ``parallel.transport`` one-sided transfers cost (``Link.put``).
- γ: an allreduce sweep over every rank (float32 sums of 64 KiB to 4 MiB):
  what the allreduce takes beyond the α–β time of MPICH's algorithm, per
  reduced byte ((P-1)/P of the message): the reductions and the copies
  the transport makes on the rank's CPU. The CPU time the rank spent per
  allreduced byte (user + system, all threads) is written beside it.
  The sharded scheme's ReduceScatter does the same reduction on the same
  share of its buffer, so the model charges it the same γ
  (``Link.reduce_scatter``); an Allgather reduces nothing (no γ).

- the transfer's cost to the compute, and the link while computing: a
  4 MiB Iallreduce runs while the main thread computes (matrix products,
  testing the request between them as the dispatcher's workers do, and a
  progress thread testing it every millisecond as its progress thread does).
  ``cpu_s_per_byte`` is how much longer the same products took than alone,
  per allreduced byte: the wall time the transfer takes from the compute
  on this host (TCP copies, the kernel's network stack, the polling) --
  close to 0 with free cores or RDMA, large on an oversubscribed host;
  ``beta_busy_bytes_per_s`` is the rate the allreduce moved its bytes at
  meanwhile. Both apply to a ReduceScatter's and an Allgather's bytes
  too (each sends (N-1)/N of its buffer, half an allreduce's).
- ranks sharing a host (``node``, node.py): three kernel classes (host
  products, memory-bound sums, a small op handed to a worker thread) timed
  on 1 and on k = 2 .. (the ranks a host) ranks of a host at once, the
  others asleep (``contention``), and a small Iallreduce over the first k
  ranks tested as the dispatcher tests it, beyond its α–β time
  (``collective_wait``).

The file (JSON, ``"format": "purine_mpi.link"``) holds ``alpha_s``,
``beta_bytes_per_s``, ``alpha_put_s``, ``beta_put_bytes_per_s``, ``gamma_s_per_byte``, ``cpu_s_per_byte``,
``beta_busy_bytes_per_s``, ``node``, ``origin``, the ranks' ``hosts`` (from
``MPI.Get_processor_name``) and the raw measurements. When every rank ran
on one host the figures are MPI's shared-memory transport, not a network:
the file's ``one_host`` is true with a ``note`` saying so, and the command
prints that note (``ONE_HOST_NOTE``) on stderr.
"""
import os
import socket
import statistics
import time

import numpy as np

from ...base.errors import UserError
from .link import Link, save_link

PING_SIZES = (8, 1 << 10, 1 << 16, 1 << 20, 1 << 22)
SWEEP_SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)


ONE_HOST_NOTE = (
    "note: all {p} ranks ran on one host ({host}): these figures measure MPI's shared "
    "memory within a host (alpha {alpha}, beta {beta}), not a network link; predictions "
    "with this file assume every rank pair talks that fast. To measure the network, run "
    "one rank per host on two hosts (mpiexec -n 2 -ppn 1, or srun -N 2 "
    "--ntasks-per-node=1)")


def one_host_note(p, host, alpha, beta):
    return ONE_HOST_NOTE.format(p=p, host=host, alpha=f"{alpha * 1e6:.3g} us",
                                beta=f"{beta / 1e9:.3g} GB/s")


def _repeats(nbytes):
    return 30 if nbytes <= 1 << 16 else 8 if nbytes <= 1 << 20 else 5


def ping_pong(comm, nbytes):
    """Half the median round trip of ``nbytes`` between ranks 0 and 1 (the
    other ranks wait at the barrier)."""
    buf = np.zeros(max(1, nbytes), np.uint8)
    times = []
    comm.Barrier()
    for _ in range(_repeats(nbytes) + 1):
        t = time.perf_counter()
        if comm.rank == 0:
            comm.Send(buf, 1, 7)
            comm.Recv(buf, 1, 7)
        elif comm.rank == 1:
            comm.Recv(buf, 0, 7)
            comm.Send(buf, 0, 7)
        times.append((time.perf_counter() - t) / 2)
    comm.Barrier()
    return statistics.median(times[1:])  # the first includes the connection set-up


def put_pong(comm, nbytes):
    """Half the median round trip of ``nbytes`` between ranks 0 and 1 by
    ``MPI_Put`` into each other's window and a notify (the module
    docstring); the other ranks take part in the window's allocation only."""
    from mpi4py import MPI
    n = max(1, nbytes)
    win = MPI.Win.Allocate(n + 8, 1, comm=comm)
    try:
        mem = np.frombuffer(win.tomemory(), np.uint8)
        word = mem[n:n + 8].view(np.int64)
        word[0] = 0
        src, one = np.zeros(n, np.uint8), np.ones(1, np.int64)
        comm.Barrier()
        win.Lock_all()
        peer, count, times = 1 - comm.rank, 0, []

        def put():
            win.Put(src, peer, target=0)
            win.Flush(peer)
            win.Accumulate(one, peer, target=n, op=MPI.SUM)
            win.Flush(peer)

        def wait(k):
            while True:
                win.Sync()
                if word[0] >= k:
                    return
                # drive MPI's progress: a library that does RMA in software
                # (MPICH over TCP) applies a peer's Put only inside an MPI call
                comm.Iprobe()

        for _ in range(_repeats(nbytes) + 1):
            t = time.perf_counter()
            count += 1
            if comm.rank == 0:
                put()
                wait(count)
            elif comm.rank == 1:
                wait(count)
                put()
            times.append((time.perf_counter() - t) / 2)
        win.Unlock_all()
        comm.Barrier()
    finally:
        win.Free()
    return statistics.median(times[1:])


def _alpha_beta(ping):
    """(α, β) of a ping-pong table {bytes: seconds}: α the 8-byte time, β
    the slope between the two largest sizes."""
    big, mid = PING_SIZES[-1], PING_SIZES[-2]
    slope = (ping[big] - ping[mid]) / (big - mid)
    return ping[8], (1.0 / slope if slope > 0 else big / max(ping[big], 1e-12))


def allreduce_time(comm, nbytes):
    """(median wall seconds, median CPU seconds of this process) of an
    Allreduce (sum) of ``nbytes`` of float32 over every rank."""
    from mpi4py import MPI
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    wall, cpu = [], []
    for _ in range(_repeats(nbytes) + 1):
        comm.Barrier()
        t, c = time.perf_counter(), time.process_time()
        comm.Allreduce(send, recv, MPI.SUM)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall[1:]), statistics.median(cpu[1:])


def _products(a, steps, request=None, lock=None):
    """``steps`` float32 matrix products (the GIL released, as the ops'),
    testing ``request`` between them; seconds taken."""
    t = time.perf_counter()
    for _ in range(steps):
        np.dot(a, a)
        if request is not None:
            with lock:
                request.Test()
    return time.perf_counter() - t


def overlap_cost(comm, nbytes=1 << 24, repeats=5):
    """(seconds the products lost per allreduced byte, bytes per second the
    allreduce moved while they ran): medians over ``repeats``."""
    import threading

    from mpi4py import MPI
    a = np.random.default_rng(0).random((128, 128), dtype=np.float32)
    step = statistics.median(_products(a, 20) / 20 for _ in range(3))
    alone_ar = allreduce_time(comm, nbytes)[0]
    steps = int(comm.allreduce(int(2.5 * alone_ar / max(step, 1e-6)) + 10, op=MPI.MAX))
    buf = np.ones(nbytes // 4, np.float32)
    p = comm.size
    moved = 2 * (p - 1) / p * nbytes
    lost, rates = [], []
    for _ in range(repeats):
        comm.Barrier()
        alone = _products(a, steps)
        comm.Barrier()
        lock, done = threading.Lock(), []
        t0 = time.perf_counter()
        request = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def progress():
            while True:
                with lock:
                    if request.Test():
                        done.append(time.perf_counter())
                        return
                time.sleep(1e-3)

        thread = threading.Thread(target=progress, daemon=True)
        thread.start()
        busy = _products(a, steps, request, lock)
        thread.join()
        lost.append((busy - alone) / moved)
        rates.append(moved / max(done[0] - t0, 1e-9))
    return max(0.0, statistics.median(lost)), statistics.median(rates)


def quiet_barrier(comm, poll=1e-3):
    """A barrier whose waiting ranks sleep between tests (MPI's blocking
    barrier spins on a core: a rank left out of a measurement must not take
    a core from the ranks measured)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


def threads_for(k):
    """The host-product threads a rank of a run of ``k`` ranks on this host
    picks: ``base/threads.decide`` with the busy cores this rank measured at
    its start-up (the user's count where one is set)."""
    from ...base import threads as _threads
    mine = dict(os.environ)
    if "OMP_NUM_THREADS" not in _threads._set_before:  # ours (exported), not the user's
        mine.pop("OMP_NUM_THREADS", None)
    mine["PURINE_LOCAL_SIZE"] = str(k)
    try:
        return _threads.decide(mine, busy=_threads.BUSY)[0]
    except ValueError:
        return 1


def _kernels(k):
    """{class: a function doing a fixed amount of that class's work} of
    node.CLASSES (node.py), the host products at the threads a run of
    ``k`` ranks on this host picks (``threads_for``). ``dispatch`` hands
    a small op to a worker thread and waits for it (an Event each way), as
    the dispatcher readies an op for a worker and hears it is done: the
    interpreter's work and a thread's wake-up, which a loaded core delays."""
    import threading

    from ...ops import hostgemm
    rng = np.random.default_rng(0)
    a = rng.random((512, 800), dtype=np.float32)   # an im2col product of a small conv
    b = rng.random((800, 64), dtype=np.float32)
    out = np.empty((512, 64), np.float32)
    x = rng.random(1 << 20, dtype=np.float32)      # 4 MiB: past the caches
    y = np.empty_like(x)
    s, t = rng.random(256, dtype=np.float32), np.empty(256, np.float32)
    count = threads_for(k)
    go, done = threading.Event(), threading.Event()

    def worker():
        while True:
            go.wait()
            go.clear()
            np.multiply(s, 0.5, out=t)
            done.set()

    threading.Thread(target=worker, daemon=True).start()

    def gemm():
        before, hostgemm.THREADS = hostgemm.THREADS, count
        try:
            hostgemm.matmul(np, a, b, out)
        finally:
            hostgemm.THREADS = before

    def elementwise():
        np.maximum(x, 0.0, out=y)
        np.add(x, y, out=y)

    def dispatch():
        for _ in range(20):
            go.set()
            done.wait()
            done.clear()

    return {"gemm": gemm, "elementwise": elementwise, "dispatch": dispatch}


#: seconds each kernel class runs without a break in one measurement: long
#: enough that a rank woken from its wait has no scheduler credit left (a
#: short burst after a sleep runs ahead of the processes that kept running)
CONTENTION_WINDOW_S = 0.2


def contention(comm, rounds=3):
    """{k: {class: time a call takes with k ranks of this host running at
    once / time alone}} for k = 2 .. the ranks on this host (node.py): in
    ``rounds`` rounds, k = 1, 2, ... interleaved, the host's first k ranks
    call each class's kernel without a break for ``CONTENTION_WINDOW_S``
    while the others sleep (``quiet_barrier``); the median over the rounds
    and the running ranks of every host of the mean time a call took. {}
    with one rank a host."""
    from mpi4py import MPI
    from .node import CLASSES
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        size = local.size
        most = comm.allreduce(size, op=MPI.MIN)
        if most < 2:
            return {}
        kernels = {k: _kernels(k) for k in range(1, most + 1)}
        times = {k: {c: [] for c in CLASSES} for k in kernels}
        for _ in range(rounds):
            for k in kernels:
                quiet_barrier(comm)
                if local.rank < k:
                    for cls in CLASSES:
                        fn = kernels[k][cls]
                        fn()  # warm: caches, the pool's threads
                        calls, t0 = 0, time.perf_counter()
                        while time.perf_counter() - t0 < CONTENTION_WINDOW_S:
                            fn()
                            calls += 1
                        times[k][cls].append((time.perf_counter() - t0) / calls)
                quiet_barrier(comm)
        every = comm.allgather(times)
    finally:
        local.Free()
    med = {k: {c: statistics.median([v for t in every for v in t[k][c]]) for c in CLASSES}
           for k in kernels}
    return {k: {c: med[k][c] / med[1][c] for c in CLASSES} for k in kernels if k > 1}


def collective_wait(comm, link, nbytes=1024, repeats=40):
    """({k: seconds}, {k: seconds}) for k = 2 .. the ranks: a small
    Iallreduce (``nbytes``) over the first k ranks, waited for the
    dispatcher's way (runtime/dispatcher.py): posted, tested every
    ``poll_interval`` until done, then a worker thread woken (an Event) as
    the dispatcher wakes the worker whose op the transfer readies. The
    first is the mean time from the post until the worker runs, less the
    α–β model's time for it (``link``; at least 0): what a collective costs
    beyond α; the second the mean of its last part, from the test that saw it done
    until the worker runs (a trace's comm span ends at that test: the part
    a traced collective does not hold). node.py."""
    import inspect
    import threading

    from mpi4py import MPI

    from ...runtime.dispatcher import Dispatcher
    poll = inspect.signature(Dispatcher.__init__).parameters["poll_interval"].default
    wait, handoff = {}, {}
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    go, woke = threading.Event(), []
    stop = [False]

    def worker():
        while True:
            go.wait()
            go.clear()
            if stop[0]:
                return
            woke.append(time.perf_counter())

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        for k in range(2, comm.size + 1):
            sub = comm.Split(0 if comm.rank < k else MPI.UNDEFINED, comm.rank)
            whole, last = [], []
            if sub != MPI.COMM_NULL:
                for _ in range(repeats + 1):
                    quiet_barrier(sub)
                    t = time.perf_counter()
                    request = sub.Iallreduce(send, recv, MPI.SUM)
                    while not request.Test():
                        time.sleep(poll)
                    seen = time.perf_counter()
                    go.set()
                    while len(woke) == 0:
                        time.sleep(poll / 10)
                    awake = woke.pop()
                    whole.append(awake - t)
                    last.append(awake - seen)
                sub.Free()
            every = comm.allgather((whole[1:], last[1:]))
            # the mean, not the median: an iteration's collectives add up,
            # and on a loaded host their times have a long tail
            wait[k] = max(0.0, statistics.fmean([v for w, _ in every for v in w])
                          - link.allreduce(k, nbytes))
            handoff[k] = statistics.fmean([v for _, h in every for v in h])
            quiet_barrier(comm)
    finally:
        stop[0] = True
        go.set()
        thread.join()
    return wait, handoff


def calibrate(path):
    """Measure and, on rank 0, write ``path``; returns the file's content
    on rank 0, None elsewhere."""
    from ...comm.world import get_world
    world = get_world()
    comm = world.comm
    if world.size < 2:
        raise UserError("predict --calibrate measures the link between ranks: run it under "
                        "mpiexec -n 2 (or more), one rank per host you want to measure "
                        "between")
    ping, puts = {}, {}
    for b in PING_SIZES:  # side by side, size by size
        ping[b] = ping_pong(comm, b)
        puts[b] = put_pong(comm, b)
    alpha, beta = _alpha_beta(ping)
    alpha_put, beta_put = _alpha_beta(puts)
    sweep = {b: allreduce_time(comm, b) for b in SWEEP_SIZES}
    wire = Link(alpha, beta, 0.0)
    p = world.size
    pof2 = 1 << (p.bit_length() - 1)
    share = (pof2 - 1) / pof2
    extra = [(sweep[b][0] - wire.allreduce(p, b, "auto")) / (share * b)
             for b in SWEEP_SIZES if b >= 1 << 20]
    gamma = max(0.0, statistics.median(extra))
    cpu_per_byte = statistics.median(sweep[b][1] / b for b in SWEEP_SIZES if b >= 1 << 20)
    cpu_per_byte = comm.allreduce(cpu_per_byte) / p
    cpu_cost, beta_busy = overlap_cost(comm)
    cpu_cost = comm.allreduce(cpu_cost) / p
    beta_busy = min(comm.allgather(beta_busy))
    from mpi4py import MPI
    ratio = contention(comm)
    wait, handoff = collective_wait(comm, wire)
    hosts = comm.allgather(MPI.Get_processor_name())
    per_host = min(hosts.count(h) for h in set(hosts))
    if world.rank != 0:
        return None
    hosts = sorted(set(hosts))
    note = one_host_note(p, hosts[0], alpha, beta) if len(hosts) == 1 else None
    from .node import NodeModel
    node = NodeModel(ratio, wait, per_host, across_hosts=len(hosts) > 1, handoff=handoff)
    link = Link(alpha, beta, gamma, cpu=cpu_cost, beta_busy=min(beta_busy, beta), node=node,
                alpha_put=alpha_put, beta_put=beta_put, origin=
                f"calibrated by predict --calibrate on {p} ranks ({socket.gethostname()}, "
                f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')})")
    extra_fields = {
        "ranks": p, "hosts": hosts, "one_host": note is not None,
        **({"note": note[len("note: "):]} if note else {}),
        "cpu_s_per_allreduced_byte_blocking": cpu_per_byte,
        "ping_pong_s": {str(b): t for b, t in ping.items()},
        "put_pong_s": {str(b): t for b, t in puts.items()},
        "allreduce_s": {str(b): {"wall": w, "cpu": c} for b, (w, c) in sweep.items()},
    }
    save_link(path, link, extra_fields)
    return {"link": path, "alpha_s": alpha, "beta_bytes_per_s": beta, "gamma_s_per_byte": gamma,
            "cpu_s_per_byte": link.cpu, "beta_busy_bytes_per_s": link.beta_busy,
            "alpha_put_s": alpha_put, "beta_put_bytes_per_s": beta_put, "ranks": p,
            "hosts": hosts, "one_host": note is not None, "note": note,
            "node": node.as_dict()}
