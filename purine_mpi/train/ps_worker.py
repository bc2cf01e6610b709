"""A parameter-server worker's stop agreement and checkpoints (a loop
service, in the place of ``StopAgreement``): the workers and the servers
agree on the stop (train/ps_server.py, async_server.py), and before a
checkpoint rank 0 takes the momenta the servers hold.
"""
from ..graph.solver_graph import momentum_name
from .async_server import STOP_REQUEST_TAG, STOP_TAG
from ..parallel.param_server import ps_layout
from ..parallel.schemes.param_server import asynchronous, lockstep
from .ps_server import recv_state, state_transfer_due
from ..runtime.stop import StopSignal
from .signals import StopAgreement


class WorkerStopAgreement(StopAgreement):
    """``world`` is the global World (the loop's is the workers')."""

    def __init__(self, job, world):
        self.world, self.job = world, job
        self.servers = ps_layout(world.size, job.parallel.ps_ranks)["servers"]
        self.mode = job.parallel.mode
        self.stopping = False  # a stop (not a divergence) before max_iter was agreed

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

    def before_save(self, loop, iteration):
        due = self.stopping or state_transfer_due(self.job, iteration, loop.state.start_iter,
                                                  final_only=asynchronous(self.mode))
        if due and self.world.rank == 0:
            # the servers hold the momenta: put them where save() looks
            for p, m in recv_state(self.world, self.servers).items():
                loop.ws.arrays[momentum_name(p)] = m
