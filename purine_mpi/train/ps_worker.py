"""A parameter-server worker's stop agreement and checkpoints (a loop
service, in the place of ``StopAgreement``): the workers and the servers
agree on the stop (train/ps_server.py, async_server.py), and before a
checkpoint rank 0 takes the momenta the servers hold.

Under async each worker holds the weights it last pulled: they differ
between workers, and none holds the pushes applied after its last pull.
So where the model is read -- a test pass, a checkpoint -- rank 0 takes
the servers' weights with their momenta (asked for between two pushes;
sent unasked at the end and on a stop) and every worker adopts those
weights (as a pull would: the next push is a gradient at them). The
figures of a test pass, the checkpoints and the final line are then those
of one model, the servers'.
"""
from ..graph.solver_graph import momentum_name
from .async_server import STATE_REQUEST_TAG, STOP_REQUEST_TAG, STOP_TAG
from ..parallel.param_server import ps_layout
from ..parallel.schemes.param_server import asynchronous, lockstep
from .ps_server import recv_state, state_transfer_due
from ..runtime.stop import StopSignal
from .signals import StopAgreement


class WorkerStopAgreement(StopAgreement):
    """``world`` is the global World (the loop's is the workers')."""

    def __init__(self, job, world):
        self.world, self.job = world, job
        self.servers = ps_layout(world.size, job.parallel.ps_ranks, job.path)["servers"]
        self.mode = job.parallel.mode
        self.stopping = False  # a stop (not a divergence) before max_iter was agreed
        # async: the iteration whose servers' state the workers hold, and (rank
        # 0) the servers' momenta of it, for the checkpoint; sync_ps: the
        # iteration whose momenta rank 0 received (once: a best checkpoint
        # and the run's checkpoint of one iteration both take them)
        self.synced, self.momenta, self.received = None, {}, None

    def on_start(self, loop):
        """sync_ps on one node: the weights are the servers' regions, which
        every worker writes while it sets its starting weights (fillers,
        then --init or --resume). No worker reads them in its first
        iteration before every worker wrote its last value (a barrier of the
        workers; the servers write the same values)."""
        graph = loop.graphs.graph
        if lockstep(self.mode) and loop.world.size > 1 and any(
                b.attrs.get("window_views") for b in graph.blobs.values()):
            loop.world.barrier()

    def agree(self, loop, done, diverged):
        """sync_ps: workers and servers agree (the servers run in lockstep).
        async: the workers agree, rank 0 first taking any stop request a
        server sent, then telling the servers the outcome."""
        world, servers, stop = self.world, self.servers, loop.state.stop
        max_iter = self.job.solver.max_iter
        if lockstep(self.mode):
            code = stop.agree(world, diverged)
        else:
            if world.rank == 0:
                for s in servers:
                    if world.comm.Iprobe(source=s, tag=STOP_REQUEST_TAG):
                        name = world.comm.recv(source=s, tag=STOP_REQUEST_TAG)
                        stop.name = stop.name or name
            code = stop.agree(loop.world, diverged)
            if code and world.rank == 0:
                if done != max_iter:
                    for s in servers:
                        world.send_object(code, s, STOP_TAG, "the stop decision")
                elif code == StopSignal.DIVERGED:  # the servers sent their final state
                    recv_state(world, servers)
        self.stopping = bool(code) and code != StopSignal.DIVERGED and done != max_iter
        return code

    def on_test(self, loop, done):
        """async: the servers' weights on every worker before the pass
        (the evaluation comes next in the list)."""
        if asynchronous(self.mode) and done != loop.state.start_iter and loop.test is not None:
            self.sync(loop, done)

    def sync(self, loop, done):
        """async, after iteration ``done``: rank 0 takes the servers' state
        (asked for, or sent unasked at the end and on a stop), and every
        worker sets the servers' weights. Collective over the workers; once
        an iteration."""
        if self.synced == done:
            return
        self.synced = done
        loop.train.drain()  # the last pulls are in: nothing writes the weights now
        weights = None
        if self.world.rank == 0:
            unasked = self.stopping or done == self.job.solver.max_iter
            if not unasked:
                for s in self.servers:
                    self.world.send_object(None, s, STATE_REQUEST_TAG, "a state request")
            self.momenta, weights = recv_state(self.world, self.servers)
        if loop.world.size > 1:
            weights = loop.world.allgather_object(weights, "the servers' weights")[0]
        for p, value in weights.items():
            loop.ws.set(p, value)

    def before_save(self, loop, iteration):
        if asynchronous(self.mode):
            # a save before any iteration ran (solver.max_iter 0, --iters 0):
            # the servers hold the starting values the workers hold, and send
            # nothing (ps_server.state_transfer_due); waiting for their state
            # was a hang until the stall timeout. As in sync_ps, no momenta.
            due = self.world.rank == 0 and iteration > loop.state.start_iter
            if iteration > loop.state.start_iter:
                self.sync(loop, iteration)
            momenta = self.momenta
        else:
            due = self.sent(loop, iteration)
            momenta = self.receive(iteration) if due and self.world.rank == 0 else {}
        if not due and self.world.rank == 0 and iteration == loop.state.start_iter > 0:
            # resumed, and saved before any update: the servers send nothing
            # (nothing changed), and hold the momenta of the checkpoint
            # resumed from; taken from that file, not left out (a file with
            # no momenta, whose resume started them from zero)
            momenta = self.resumed_momenta(loop, iteration)
            due = bool(momenta)
        if due and self.world.rank == 0:
            # the servers hold the momenta: put them where save() looks
            for p, m in momenta.items():
                loop.ws.arrays[momentum_name(p)] = m

    def resumed_momenta(self, loop, iteration):
        """Rank 0: the momenta of the servers' parameters in the checkpoint
        of ``iteration`` the run resumed from (``RunState.last_finite``: the
        file resumed, or this run's latest.h5 of that iteration since), as
        the servers loaded them (ps_server.run_server); {} where it holds
        none."""
        last = loop.state.last_finite
        if not last or int(last[1]) != iteration:
            return {}
        from ..job.checkpoint_file import load_solver
        states = load_solver(last[0])   # {param: {state: array}} of the file
        return {p: states[p]["momentum"] for p in loop.graphs.composition.server_plan["order"]
                if "momentum" in states.get(p, {})}

    def sent(self, loop, iteration):
        """sync_ps: whether the servers sent rank 0 their state after
        ``iteration`` (ps_server.state_transfer_due, or a stop)."""
        return iteration > loop.state.start_iter and (self.stopping or state_transfer_due(
            self.job, iteration, loop.state.start_iter, final_only=False))

    def receive(self, iteration):
        """sync_ps, rank 0: the servers' momenta after ``iteration``,
        received once (a best checkpoint and the run's checkpoint of the
        same iteration both save them)."""
        if self.received != iteration:
            self.received, self.momenta = iteration, recv_state(self.world, self.servers)[0]
        return self.momenta

    def after_iteration(self, loop, done):
        """sync_ps, rank 0: the state the servers sent after a test pass
        that wrote no checkpoint is taken all the same (every transfer is
        matched); let go unless the run's checkpoint of ``done`` follows (at
        the interval, on a stop, at the end: Checkpoints, after this)."""
        if lockstep(self.mode) and self.world.rank == 0 and self.sent(loop, done):
            self.receive(done)
            if done != self.job.solver.max_iter and not loop.state.stop_code and \
                    not loop.due(self.job.checkpoint.interval, done):
                self.momenta = {}

    def after_save(self, loop, iteration):
        """The momenta put for the save let go (the servers' keep changing):
        rank 0 holds them only while it saves (async: the agreement keeps
        the last sync's, ``ParameterServers.held_bytes``; sync_ps: until the
        run's checkpoint of the iteration, after a best one)."""
        for p in loop.graphs.composition.server_plan["order"]:
            loop.ws.arrays.pop(momentum_name(p), None)
        if lockstep(self.mode) and loop.state.last_saved == iteration:
            self.momenta = {}
