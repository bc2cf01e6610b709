"""Posting communication ops the moment their inputs exist, and driving
their progress: the one place the dispatchers call MPI from.

``CommPoster`` holds an iteration's comm ops. Whichever thread makes an op
ready -- the worker that wrote a bucket's last gradient, usually -- calls
``progress()`` right away, which posts what is ready and tests the requests
in flight (one ``Testall`` per op), completing those that finished.

Posting order:

- *ordered* ops (collectives: a bucket's Allreduce) are posted in their
  ``seq`` order, fixed at graph build time and the same on every rank (MPI
  matches collectives by call order): a ready op behind an unposted one
  waits for it;
- *unordered* ops (point-to-point Send/Recv: a parameter server's push and
  pull, a pipeline's activations and gradients) are matched by peer and
  tag, so each is posted as soon as it is ready, whatever the ops before it
  in ``seq`` wait for.

Who drives progress: worker threads call ``progress()`` between ops; the
dispatcher's progress thread calls it while every worker is idle and, while
a worker runs a long op, whenever no thread has tested for ``busy_poll``
seconds (a large transfer only moves inside an MPI call; without that, a
24 MB allreduce posted before a 100 ms convolution would wait for its end).

Every MPI call here runs under ``comm.world.MPI_LOCK``, so one thread at a
time is in MPI (what MPI_THREAD_SERIALIZED asks for). A thread never waits
for that lock: if another is in MPI, it goes back to its compute, and the
one inside posts whatever became ready before it leaves.

Device hook: ``gate(name) -> bool``, given at construction, says whether an
op whose host-side inputs are all ready (``mark_ready``) may be posted *now*
-- the GPU dispatcher answers it by querying (never waiting on) the CUDA
events recorded after the device work that wrote the op's inputs (a stream's
kernels or a CUDA-graph segment). A closed gate holds the op (and, for an
ordered op, every ordered op after it) and is asked again at the next
``progress()``; posting order and timing bookkeeping stay the same. A device
that can tell when a segment finished may instead call ``mark_ready`` then
(any thread; cheap, takes no MPI lock) and leave ``gate`` out.

Timing: ``ready_at[name]`` is when the op's last input was written (host
side) and ``posted_at[name]`` when it was posted; their difference is the
*post latency* that ``bench --json`` reports per bucket and the trace shows
(``args.post_latency_us`` of the comm event). ``last_test`` is when a thread
last ran ``progress()`` (the progress thread's cue).
"""
import itertools
import time

from ..comm.world import MPI_LOCK
from ..base.errors import OpError
from .scheduler import PostingOrder


class CommPoster:
    """Posts ``order`` (comm op names, in ``seq`` order) as they become
    ready and completes them.

    ``post(name)`` posts one op and returns a Pending (or None when it
    finished at once); ``complete(name)`` tells the dispatcher an op is done
    (it may mark further ops ready); ``record(name, t_post, t_done, args)``
    writes its trace event. ``unordered``: names posted as soon as ready
    (point-to-point); ``gate``: the device-readiness predicate (see the
    module docstring)."""

    def __init__(self, order, post, complete, record=None, rank=0, unordered=(), gate=None):
        self._post = post
        self._complete = complete
        self._record = record
        self._gate = gate
        self.rank = rank
        #: the posting rule (runtime/scheduler.PostingOrder), shared with
        #: the scaling simulator
        self.posting = PostingOrder(order, unordered)
        self.pending = []  # (name, op, Pending, t_post, trace args)
        self.reset()

    def reset(self):
        """Start an iteration: nothing ready, nothing posted. Transfers still
        in flight (a deferred tail's: every op of the last iteration was
        posted) stay in ``pending`` and complete as before."""
        with MPI_LOCK:
            if self.pending and not self.all_posted():  # an aborted iteration's
                self.pending = []
            self.posting.reset()
            self.posted_at = {}
            self._marks = itertools.count(1)
            self._last_mark = 0
            self.last_test = time.perf_counter()

    def all_posted(self):
        """Every op of this iteration has been posted (a cheap check)."""
        return self.posting.all_posted()

    @property
    def order(self):
        """The comm op names in their posting order."""
        return self.posting.order

    @property
    def ready_at(self):
        """{name: when its inputs were all written} (this iteration)."""
        return self.posting.ready_at

    def set_order(self, order):
        """A new posting order (the same on every rank; between iterations)."""
        if sorted(order) != sorted(self.order):
            raise ValueError("a new posting order must hold the same comm ops")
        self.posting.set_order(order)

    def mark_ready(self, name):
        """``name``'s inputs are all written (any thread; takes no lock)."""
        self.posting.mark_ready(name, time.perf_counter())
        self._last_mark = next(self._marks)  # atomic: progress() looks for news

    def has_work(self):
        """Anything to post or to test (a cheap check without the lock)."""
        return bool(self.pending) or self.posting.postable()

    def progress(self, ops):
        """Post what is ready (in order), test what is in flight, complete
        what finished. Returns the number of ops completed.

        Never waits for another thread's MPI call: when one is in MPI
        already (a Test that moves a large transfer may take milliseconds),
        this returns at once, and that thread posts what is ready before it
        lets go -- including what became ready meanwhile (checked again after
        the lock is released, so a post is never lost)."""
        done = 0
        while self.has_work():
            if not MPI_LOCK.acquire(blocking=False):
                return done
            try:
                # post first: testing a large transfer in flight may itself
                # move data for a while (MPI progresses inside Test), and a
                # ready bucket should not wait behind that
                done += self._post_ready(ops)
                done += self._test(ops)
                seen = self._last_mark
                done += self._post_ready(ops)  # what the completions made ready
                self.last_test = time.perf_counter()
            finally:
                MPI_LOCK.release()
            if self._last_mark == seen:  # nothing was readied since our last look
                break
        return done

    def _post_ready(self, ops):
        # An op leaves the ready set only once it is in ``pending``: another
        # thread's has_work() must never see it in neither (it would go to
        # sleep while the transfer waits to be tested).
        return self.posting.post_ready(lambda name: self._post_one(name, ops), self._gate)

    def _post_one(self, name, ops):
        self.posted_at[name] = time.perf_counter()
        try:
            result = self._post(name)
        except OpError:
            raise
        except Exception as exc:
            raise OpError(ops[name], exc, self.rank) from exc
        if result is None:  # done at once (one rank): traced by the post itself
            self._complete(name)
            return 1
        self.pending.append((name, ops[name], result, self.posted_at[name],
                             self.latency_args(name)))
        return 0

    def _test(self, ops):
        done, still = 0, []
        for entry in self.pending:
            name, op, p, t_post, args = entry
            try:
                finished = p.test()
                if finished:
                    p.finish()
            except Exception as exc:
                raise OpError(op, exc, self.rank) from exc
            if finished:
                if self._record is not None:
                    spans = getattr(p, "spans", None)  # a one-sided op's parts (comm/rma_ops.py)
                    self._record(op, t_post, time.perf_counter(),
                                 dict(args, spans=spans) if spans else args)
                self._complete(name)
                done += 1
            else:
                still.append(entry)
        self.pending = still
        return done

    def latency_args(self, name):
        """Trace args of a comm event: when its inputs were ready, and how
        long after that it was posted."""
        ready = self.ready_at.get(name)
        if ready is None or name not in self.posted_at:
            return {}
        return {"ready_s": ready, "post_latency_us": round((self.posted_at[name] - ready) * 1e6, 1)}

    def oldest_post(self):
        return min((e[3] for e in self.pending), default=None)

    def in_flight(self):
        return [(e[1], e[2]) for e in self.pending]

    def held(self):
        """Ready ops not posted yet, with why: (name, reason)."""
        p = self.posting
        out = [(n, "its device work has not finished") for n in list(p.free)]
        if p.next < len(p.chain):
            head = p.chain[p.next]
            if head in p.ready_at:
                out.append((head, "its device work has not finished"))
            out += [(n, f"posted after '{head}' (seq order)") for n in p.chain[p.next + 1:]
                    if n in p.ready_at]
        return out
