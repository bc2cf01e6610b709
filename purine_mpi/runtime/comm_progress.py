"""Posting communication ops the moment their inputs exist, and driving
their progress: the one place the dispatchers call MPI from.

``CommPoster`` holds an iteration's comm ops in posting order (``seq``, fixed
at graph build time and the same on every rank). Whichever thread makes an
op ready -- the worker that wrote a bucket's last gradient, usually -- calls
``progress()`` right away, which posts every op whose inputs are ready, in
order, as long as every op before it has been posted; a ready op behind an
unposted one waits for it, so every rank posts the same sequence. The same
call tests the requests in flight (one ``Testall`` per op) and completes
those that finished. Worker threads call it between ops; the dispatcher's
progress thread calls it only while every worker is idle (on a busy core it
would only take time from the compute that produces the next gradients).

Every MPI call here runs under ``comm.world.MPI_LOCK``, so one thread at a
time is in MPI (what MPI_THREAD_SERIALIZED asks for).

The GPU dispatcher uses the same helper: its comm op's ``post`` returns a
Pending that is posted for real once the device work (the CUDA-graph
segment or stream work) that wrote its inputs has finished; the poster's
order and timing bookkeeping stay the same.

Timing: ``ready_at[name]`` is when the op's last input was written and
``posted_at[name]`` when it was posted; their difference is the *post
latency* that ``bench --json`` reports per bucket and the trace shows
(``args.post_latency_us`` of the comm event).
"""
import time

from ..comm.world import MPI_LOCK
from ..errors import OpError


class CommPoster:
    """Posts ``order`` (comm op names, in posting order) as they become
    ready and completes them.

    ``post(name)`` posts one op and returns a Pending (or None when it
    finished at once); ``complete(name)`` tells the dispatcher an op is done
    (it may mark further ops ready); ``record(name, t_post, t_done, args)``
    writes its trace event."""

    def __init__(self, order, post, complete, record=None, rank=0):
        self.order = list(order)
        self._post = post
        self._complete = complete
        self._record = record
        self.rank = rank
        self.reset()

    def reset(self):
        """Start an iteration: nothing ready, nothing posted."""
        self.next = 0
        self.ready_at = {}
        self.posted_at = {}
        self.pending = []  # (name, op, Pending)

    def set_order(self, order):
        """A new posting order (the same on every rank; between iterations)."""
        if sorted(order) != sorted(self.order):
            raise ValueError("a new posting order must hold the same comm ops")
        self.order = list(order)

    def mark_ready(self, name):
        """``name``'s inputs are all written (called under the dispatcher's lock)."""
        self.ready_at[name] = time.perf_counter()

    def has_work(self):
        """Anything to post or to test (a cheap check without the lock)."""
        return bool(self.pending) or (self.next < len(self.order)
                                      and self.order[self.next] in self.ready_at)

    def progress(self, ops):
        """Post what is ready (in order), test what is in flight, complete
        what finished. Returns the number of ops completed."""
        if not self.has_work():
            return 0
        with MPI_LOCK:
            # post first: testing a large transfer in flight may itself move
            # data for a while (MPI progresses inside Test), and a ready
            # bucket should not wait behind that
            done = self._post_ready(ops)
            done += self._test(ops)
            done += self._post_ready(ops)  # what the completions made ready
        return done

    def _post_ready(self, ops):
        done = 0
        while self.next < len(self.order) and self.order[self.next] in self.ready_at:
            name = self.order[self.next]
            self.next += 1
            t_post = time.perf_counter()
            self.posted_at[name] = t_post
            result = self._post(name)
            if result is None:  # done at once (one rank): traced by the post itself
                self._complete(name)
                done += 1
            else:
                self.pending.append((name, ops[name], result))
        return done

    def _test(self, ops):
        done, still = 0, []
        for name, op, p in self.pending:
            try:
                finished = p.test()
                if finished:
                    p.finish()
            except Exception as exc:
                raise OpError(op, exc, self.rank) from exc
            if finished:
                self._finished(name, op, self.posted_at[name])
                done += 1
            else:
                still.append((name, op, p))
        self.pending = still
        return done

    def _finished(self, name, op, t_post):
        if self._record is not None:
            self._record(op, t_post, time.perf_counter(), self.latency_args(name))
        self._complete(name)

    def latency_args(self, name):
        """Trace args of a comm event: when its inputs were ready, and how
        long after that it was posted."""
        ready = self.ready_at.get(name)
        if ready is None or name not in self.posted_at:
            return {}
        return {"ready_s": ready, "post_latency_us": round((self.posted_at[name] - ready) * 1e6, 1)}

    def oldest_post(self):
        return min((self.posted_at[n] for n, _, _ in self.pending), default=None)

    def in_flight(self):
        return [(op, p) for _, op, p in self.pending]
