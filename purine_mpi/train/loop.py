"""The training loop and the hooks of its services.

``Loop`` receives this rank's graphs (parallel/rank_graphs.py), their
dispatchers and a list of services; it runs iterations and asks the
services, in list order, at fixed points (Lightning's ``Callback`` hooks,
Caffe's ``Solver::Step``):

    check_start(loop)                before on_start, before any file is written: a
                                     refusal of the run's settings (exit 2) leaves
                                     the run folder as it was
    on_start(loop)                   before the first iteration of this process
    after_step(loop, done)           after every iteration's step: the loss window
    on_display(loop, done)           at the display interval
    on_stop_request(loop, done)      after every iteration: the agreed stop code
    on_test(loop, done)              at the test interval, once at the end, and at 0
                                     with solver.test_initialization
    after_iteration(loop, done)      last in every iteration: checkpoints
    on_stop(loop, done)              the run stops early (signal, early stop)
    on_end(loop)                     max_iter reached: the final checkpoint
    on_close(loop)                   always, last: files closed, trace written
    before_save(loop, iteration)     on every rank before a checkpoint is gathered
                                     (checkpoints.py asks it)

Each service keeps its own state (its settings, its counters, its open
files). What they share is one typed object, ``loop.state`` (``RunState``
below: the run's clock and checkpoint bookkeeping, the stop signal, the
metrics log, and this iteration's outcomes: ``window``, ``first_bad``,
``diverged``, ``stop_code``, ``result``, ``early_stopped``); the facts of
this rank's graphs are ``loop.graphs`` (parallel/rank_graphs.py), the
settings ``loop.job``. A new habit is a new ``Service`` and one line in the
list (train/trainer.py).

Every rank runs the same loop; the collectives the services make outside
the graph happen at the same iterations on every rank, in list order.
"""
import dataclasses
import math
import os
import time
import uuid

from ..base.rss import peak_rss_bytes
from ..comm.windows import peer_window_resident_bytes
from ..runtime.stop import StopSignal


class Service:
    """A loop service: it overrides the hooks it needs (all no-ops here)."""

    def check_start(self, loop): pass

    def on_start(self, loop): pass

    def after_step(self, loop, done): pass

    def on_display(self, loop, done): pass

    def on_stop_request(self, loop, done): pass

    def on_test(self, loop, done): pass

    def after_iteration(self, loop, done): pass

    def on_stop(self, loop, done): pass

    def on_end(self, loop): pass

    def on_close(self, loop): pass

    def before_save(self, loop, iteration): pass

    def after_save(self, loop, iteration): pass


class Window:
    """The display window: the loss summed since the last display line, its
    iterations, and where (iteration, time) this process started it.
    ``carried``: the loss sum of its iterations before the checkpoint a
    resume started from (they count in ``n``, not in the speed)."""

    def __init__(self, start, now):
        self.loss, self.n, self.start, self.t = 0.0, 0, start, now
        self.carried = 0.0

    def total(self):
        """The loss summed over the window's ``n`` iterations."""
        return self.loss + self.carried

    def reset(self, start, now):
        self.__init__(start, now)


@dataclasses.dataclass
class RunState:
    """What the loop's services share (each keeps the rest to itself).

    The run: ``start_iter``, ``elapsed0`` (training time before this
    process), ``run_id`` and ``last_saved`` (the newest checkpoint this run
    wrote) are set by a resume and the checkpoints (checkpoints.py);
    ``t_start`` by the loop; ``stop`` is the signal every rank agrees on
    (signals.py); ``metrics`` the metrics log rank 0 writes (progress.py).

    This iteration: the display ``window`` (divergence.py adds the loss,
    progress.py shows and resets it), ``first_bad`` and ``diverged``
    (divergence.py), the agreed ``stop_code`` (signals.py, divergence.py),
    the test pass's ``result`` (evaluation.py), ``early_stopped`` and
    ``watch`` (watch.py; a checkpoint holds it)."""

    start_iter: int = 0
    elapsed0: float = 0.0
    # checkpoints carry it; rotation deletes only this run's (and its resumes')
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    last_saved: object = None     # iteration of the newest checkpoint this run wrote
    # (path, iteration) of the newest checkpoint known finite, weights and
    # solver state: the one resumed (checked) or the run's latest.h5 (written
    # only after the check, divergence.py); what a diverged run names
    last_finite: object = None
    t_start: object = None        # perf_counter() when this process's first iteration began
    stop: StopSignal = dataclasses.field(default_factory=StopSignal)
    metrics: object = None        # the metrics log (rank 0, while the loop runs)
    window: object = None         # Window
    first_bad: object = None      # the first non-finite iteration, or None
    diverged: bool = False
    stop_code: int = 0
    result: dict = dataclasses.field(default_factory=dict)
    early_stopped: object = None  # the iteration early stopping ended the run at
    # (loss sum, iterations) of this rank's display window at the checkpoint
    # resumed from (Window.carried): its first row averages the whole window
    window_carry: object = None
    # the watch services' decisions so far ({"best": ..., "early_stop": ...},
    # watch.py): the checkpoints carry them, a resume gives them back
    watch: dict = dataclasses.field(default_factory=dict)
    last_loss: object = None      # (iteration, loss): the newest loss known (progress.py)
    # where the weights of this process's first iteration came from (--init,
    # a checkpoint, the fillers): the divergence message names it (trainer.py)
    weights_from: str = "the fillers of the net"
    # the resident high-water mark after the last iteration, before the end's
    # test pass and checkpoint (memory.json's ``loop_peak_rss_bytes``)
    loop_peak_rss: object = None
    # then, the pages of other ranks' shared-window regions resident here
    # (memory.json's ``peer_window_bytes``: comm/windows.peer_window_resident_bytes)
    loop_peer_window: object = None


class Loop:
    """Runs this rank's training iterations and asks its services."""

    def __init__(self, graphs, train, test, *, job, out_dir, world, scheme, services=(),
                 log=print):
        self.job, self.out_dir, self.world = job, out_dir, world  # job/job.py
        self.scheme, self.log = scheme, log
        self.graphs = graphs  # the facts of this rank's graphs (parallel/rank_graphs.py)
        self.train, self.test = train, test
        self.services = list(services)
        self.state = RunState()
        self._order_adopted = False

    @property
    def ws(self):
        """The training graph's workspace (its dispatcher's)."""
        return self.train.workspace

    # ------------------------------------------------------------ services
    def emit(self, hook, *args):
        """Call ``hook`` on every service, in list order."""
        for service in self.services:
            getattr(service, hook)(self, *args)

    # --------------------------------------------------------- the schedule
    @staticmethod
    def due(interval, done):
        return bool(interval) and done % interval == 0

    def display_due(self, done):
        display = self.job.solver.display
        return bool(display) and (done % display == 0 or done == self.job.solver.max_iter)

    def checkpoint_due(self, done):
        """Whether a checkpoint may follow iteration ``done`` (the end, a stop
        request, the interval): the weights must then be finite."""
        return done == self.job.solver.max_iter or self.state.stop.name is not None or \
            self.due(self.job.checkpoint.interval, done)

    def test_due(self, done):
        return self.due(self.job.solver.test_interval, done)

    # --------------------------------------------------------------- a step
    def step(self, it):
        """One training iteration. After this process's first one, the
        buckets are posted in the observed gradient-ready order
        (``adopt_ready_order``: decided on rank 0, the same on every rank)."""
        self.ws["iter"][...] = it
        # deferred: on a GPU the iteration returns once its device work is
        # queued (one graph launch when captured); the host synchronises only
        # where it reads back (the divergence watch, drain: display, test,
        # checkpoint, a stop signal)
        self.train.run(it, sync=not self.graphs.deferred)
        if not self._order_adopted and not self.graphs.pipeline:
            self._order_adopted = True
            from ..parallel.data_parallel import adopt_ready_order
            self.train.drain()
            adopt_ready_order(self.train, self.world)

    # ------------------------------------------------------------- the loop
    def run(self):
        max_iter, st = self.job.solver.max_iter, self.state
        # past max_iter (a resume of a later checkpoint with a smaller --iters)
        # there is nothing to do in any folder: the end's test pass and
        # checkpoint would be labelled max_iter while holding the weights of
        # start_iter (a ckpt_<max_iter>.h5 a later resume would train on from
        # the wrong iteration). At max_iter itself, a folder without the run's
        # latest.h5 gets them (the same weights, rightly labelled)
        if st.start_iter > max_iter or (st.start_iter == max_iter and self._finished()):
            self.say(f"already finished at iteration {st.start_iter}: nothing to do"
                     + (f" (solver.max_iter is {max_iter}; raise it, or give --iters, to "
                        "train on)" if st.start_iter == max_iter else
                        f" (past solver.max_iter {max_iter})"))
            self.emit("on_close")
            return {}
        st.early_stopped = None
        try:
            self.emit("check_start")  # every refusal before the first write
            self.emit("on_start")
            if self.job.test_initially and st.start_iter == 0 < max_iter:
                self.emit("on_test", 0)  # a test pass before training (Caffe's; the end's
                # own pass is the one of a run of no iteration)
            st.t_start = time.perf_counter()
            st.window = Window(st.start_iter, st.t_start)
            if st.window_carry:
                st.window.carried, st.window.n = float(st.window_carry[0]), \
                    int(st.window_carry[1])
            for it in range(st.start_iter, max_iter):
                self.step(it)
                done = it + 1
                st.window.n += 1
                st.first_bad, st.diverged, st.stop_code = None, False, 0
                self.emit("after_step", done)
                # a window that diverged before this iteration is not shown:
                # the run ended there (as it does when the loss is read every iteration)
                if self.display_due(done) and st.first_bad in (None, done):
                    self.emit("on_display", done)
                self.emit("on_stop_request", done)
                if st.stop_code == StopSignal.DIVERGED:
                    self.train.drain()
                    # the loss of this process's first iteration is that of
                    # the weights it started from: before any update where
                    # it starts at 0 (a resumed run's came from updates)
                    return {"diverged_at": st.first_bad or done,
                            "last_checkpoint": st.last_finite,
                            "initial_loss": st.first_bad == st.start_iter + 1,
                            "start_iter": st.start_iter}
                st.result = {}
                if self.test_due(done) and done != max_iter:
                    self.emit("on_test", done)
                self.emit("after_iteration", done)
                if done != max_iter and (st.early_stopped is not None or st.stop_code):
                    self.emit("on_stop", done)
                    if st.early_stopped is not None:  # the figures of this test pass
                        return dict(st.result, early_stop=done)
                    return {"stopped_by": st.stop.name, "iter": done}
            # the last evaluation and checkpoint (also after a resume past max_iter
            # into a folder without that run's latest.h5)
            st.loop_peak_rss = peak_rss_bytes()
            st.loop_peer_window = peer_window_resident_bytes()
            st.result = {}
            self.emit("on_test", max_iter)
            self.emit("on_end")
            return st.result
        finally:
            self.emit("on_close")

    # -------------------------------------------------------------- helpers
    def elapsed(self, now=None):
        """Training time in seconds, over this run and those it resumed."""
        st = self.state
        if st.t_start is None:
            return st.elapsed0
        return st.elapsed0 + (time.perf_counter() if now is None else now) - st.t_start

    def say(self, msg):
        """A line of rank 0's log."""
        if self.world.rank == 0:
            self.log(msg)

    def record(self, row):
        """A row of the metrics log (rank 0; docs/formats.md)."""
        if self.state.metrics is not None:
            self.state.metrics.write(row)

    def reduce(self, values):
        """Across ranks: the sum over a replica's stages (the last stage
        holds the loss), the mean over the replicas (each its own shard)."""
        from .collectives import world_mean
        return world_mean(self.world, values) * self.graphs.layout.stages

    def loss_now(self):
        """This iteration's loss as the host holds it (the CPU path)."""
        g = self.graphs
        value = sum(float(self.ws[b]) * share for b, share in zip(g.losses, g.loss_shares))
        return value, math.isfinite(value)

    def _finished(self):
        """Whether the run folder holds the finished run (its latest.h5), as
        rank 0 sees it (it writes the checkpoints), on every rank alike."""
        done = os.path.exists(os.path.join(self.out_dir, "latest.h5"))
        return self.world.allgather_object(done, "the finished-run check")[0] \
            if self.world.size > 1 else done

    def close(self):
        self.train.close()
        if self.test is not None:
            self.test.close()
