"""The training loop and the hooks of its services.

``Loop`` receives this rank's graphs (parallel/rank_graphs.py), their
dispatchers and a list of services; it runs iterations and asks the
services, in list order, at fixed points (Lightning's ``Callback`` hooks,
Caffe's ``Solver::Step``):

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

The services communicate through the loop's state (``window``, ``first_bad``,
``diverged``, ``stop_code``, ``result``, ``early_stopped``, ``metrics``). A
new habit is a new ``Service`` and one line in the list (trainer.py).

Every rank runs the same loop; the collectives the services make outside
the graph happen at the same iterations on every rank, in list order.

Layer: services (docs/DESIGN.md); may import the foundation, devices, data,
ops, graph, job, composition and dispatch layers below it, and its own.
"""
import math
import os
import time
import uuid

from ..runtime.stop import StopSignal


class Service:
    """A loop service: it overrides the hooks it needs (all no-ops here)."""

    def on_start(self, loop): pass

    def after_step(self, loop, done): pass

    def on_display(self, loop, done): pass

    def on_stop_request(self, loop, done): pass

    def on_test(self, loop, done): pass

    def after_iteration(self, loop, done): pass

    def on_stop(self, loop, done): pass

    def on_end(self, loop): pass

    def on_close(self, loop): pass


class Window:
    """The display window: the loss summed since the last display line, its
    iterations, and where (iteration, time) it started."""

    def __init__(self, start, now):
        self.loss, self.n, self.start, self.t = 0.0, 0, start, now

    def reset(self, start, now):
        self.__init__(start, now)


class Loop:
    """Runs this rank's training iterations and asks its services."""

    def __init__(self, graphs, train, test, *, job, out_dir, world, scheme, services=(),
                 log=print):
        self.job = job  # io/job.py
        self.solver, self.out_dir, self.seed = job.solver, out_dir, job.seed
        self.world, self.rank, self.size = world, world.rank, world.size
        self.scheme, self.log, self.graphs = scheme, log, graphs
        g = graphs  # the facts of this rank's graphs that services and tools read
        self.layout, self.pipeline, self.data_size = g.layout, g.pipeline, g.data_size
        self.graph, self.test_graph, self.device = g.graph, g.test_graph, g.device
        self.params, self.net_params, self.param_summary = g.params, g.net_params, \
            g.param_summary
        self.losses, self.loss_shares, self.watch = g.losses, g.loss_shares, g.watch
        self.deferred, self.memory_plan = g.deferred, g.memory_plan
        self.train, self.test, self.ws = train, test, train.workspace
        self.services = list(services)
        self.stop = StopSignal()
        # checkpoints carry it; rotation deletes only this run's (and its resumes')
        self.run_id = uuid.uuid4().hex
        self.start_iter = 0
        self.elapsed0 = 0.0  # training time (s) before this process: "time" goes on from it
        self.t_start = None  # perf_counter() when this process's first iteration began
        self.last_saved = None  # iteration of the newest checkpoint this run wrote
        self.metrics = None  # the metrics log (rank 0, while the loop runs)
        self._order_adopted = False
        self.max_iter, self.display = job.solver.max_iter, job.solver.display
        self.test_interval = job.solver.test_interval
        self.checkpoint_interval = job.checkpoint.interval
        self.result, self.early_stopped, self.stop_code = {}, None, 0

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
        return bool(self.display) and (done % self.display == 0 or done == self.max_iter)

    def checkpoint_due(self, done):
        """Whether a checkpoint may follow iteration ``done`` (the end, a stop
        request, the interval): the weights must then be finite."""
        return done == self.max_iter or self.stop.name is not None or \
            self.due(self.checkpoint_interval, done)

    def test_due(self, done):
        return self.due(self.test_interval, done)

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
        self.train.run(it, sync=not self.deferred)
        if not self._order_adopted and not self.pipeline:
            self._order_adopted = True
            from ..parallel.data_parallel import adopt_ready_order
            self.train.drain()
            adopt_ready_order(self.train, self.world)

    # ------------------------------------------------------------- the loop
    def run(self):
        max_iter = self.max_iter
        if self.start_iter >= max_iter and self._finished():
            self.say(f"already finished at iteration {self.start_iter}: nothing to do"
                     + (f" (solver.max_iter is {max_iter}; raise it, or give --iters, to "
                        "train on)" if self.start_iter == max_iter else
                        f" (past solver.max_iter {max_iter})"))
            self.emit("on_close")
            return {}
        self.early_stopped = None
        try:
            self.emit("on_start")
            if self.solver.test_initialization and self.start_iter == 0:
                self.emit("on_test", 0)  # a test pass before training (Caffe's)
            self.t_start = time.perf_counter()
            self.window = Window(self.start_iter, self.t_start)
            for it in range(self.start_iter, max_iter):
                self.step(it)
                done = it + 1
                self.window.n += 1
                self.first_bad, self.diverged, self.stop_code = None, False, 0
                self.emit("after_step", done)
                # a window that diverged before this iteration is not shown:
                # the run ended there (as it does when the loss is read every iteration)
                if self.display_due(done) and self.first_bad in (None, done):
                    self.emit("on_display", done)
                self.emit("on_stop_request", done)
                if self.stop_code == StopSignal.DIVERGED:
                    self.train.drain()
                    return {"diverged_at": self.first_bad or done,
                            "last_checkpoint": self.last_saved}
                self.result = {}
                if self.test_due(done) and done != max_iter:
                    self.emit("on_test", done)
                self.emit("after_iteration", done)
                if done != max_iter and (self.early_stopped is not None or self.stop_code):
                    self.emit("on_stop", done)
                    if self.early_stopped is not None:  # the figures of this test pass
                        return dict(self.result, early_stop=done)
                    return {"stopped_by": self.stop.name, "iter": done}
            # the last evaluation and checkpoint (also after a resume past max_iter
            # into a folder without that run's latest.h5)
            self.result = {}
            self.emit("on_test", max_iter)
            self.emit("on_end")
            return self.result
        finally:
            self.emit("on_close")

    # -------------------------------------------------------------- helpers
    def elapsed(self, now=None):
        """Training time in seconds, over this run and those it resumed."""
        if self.t_start is None:
            return self.elapsed0
        return self.elapsed0 + (time.perf_counter() if now is None else now) - self.t_start

    def say(self, msg):
        """A line of rank 0's log."""
        if self.rank == 0:
            self.log(msg)

    def record(self, row):
        """A row of the metrics log (rank 0; docs/formats.md)."""
        if self.metrics is not None:
            self.metrics.write(row)

    def reduce(self, values):
        """Across ranks: the sum over a replica's stages (the last stage
        holds the loss), the mean over the replicas (each its own shard)."""
        from .collectives import world_mean
        return world_mean(self.world, values) * self.layout.stages

    def loss_now(self):
        """This iteration's loss as the host holds it (the CPU path)."""
        value = sum(float(self.ws[b]) * share for b, share in zip(self.losses, self.loss_shares))
        return value, math.isfinite(value)

    def _finished(self):
        """Whether the run folder holds the finished run (its latest.h5), as
        rank 0 sees it (it writes the checkpoints), on every rank alike."""
        done = os.path.exists(os.path.join(self.out_dir, "latest.h5"))
        return self.world.allgather_object(done, "the finished-run check")[0] \
            if self.size > 1 else done

    def close(self):
        self.train.close()
        if self.test is not None:
            self.test.close()
