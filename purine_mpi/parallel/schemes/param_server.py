"""``scheme: data`` with ``mode: async | sync_ps``: parameter servers. With
N ranks the last ``ps_ranks`` hold the parameters and the others are
workers (parallel/param_server.py builds the graphs; the servers' loop is
train/ps_server.py). One scheme with two modes: the layout, the worker's
graph, the notes and the start-up lines are the same; the mode decides
whether the servers wait for every worker (sync_ps, ``lockstep``) or serve
each push at once, up to ``max_staleness`` (async, ``asynchronous``).

A run on one rank has no servers: the rank trains alone as ``scheme: data``
does (with a note). A worker's part is ``param_server.WorkerScheme(job,
world)``, this class with the worker's World and its graph.
"""
from ...base.errors import ConfigError
from .base import SERVER_KEYS, Composition, Scheme, ranks_word, register_scheme
from .data import DataParallel


def lockstep(mode):
    """Whether the servers of ``mode`` run in lockstep with the workers
    (sync_ps: one update of every worker's round, the same weights for
    all) rather than serving each push at once (async)."""
    return mode == "sync_ps"


def asynchronous(mode):
    """Whether ``mode`` serves each push at once, up to ``max_staleness`` (async)."""
    return mode == "async"


@register_scheme("param_server", scheme="data", modes=("async", "sync_ps"))
class ParameterServers(DataParallel):
    keys = SERVER_KEYS
    servers = True
    allreduces = False
    nccl = False
    #: {"workers": [...], "servers": [...]} of a worker's part (WorkerScheme), else None
    ranks = None

    def server_ranks(self):
        return self.ranks

    def compose(self, graph, grads, job, world):
        """On one rank, the replica as scheme data composes it; on several the
        workers compose through ``WorkerScheme`` (train/trainer.run_param_server)."""
        from .steps import accumulate, clipped
        # the replica's own gradients: the running sums add into them
        accumulate(graph, grads, job, in_place=True)
        if world.size == 1:
            return clipped(Composition(graph.validate(), self.layout(job, world)), job, world)
        # test and predict compose the net on every rank (no servers): they
        # evaluate a parameter-server run's weights as any other's
        raise ConfigError(job.path, "parallel.mode", f"mode '{job.parallel.mode}' "
                          "(parameter servers) runs in train and bench only; evaluate its "
                          "weights on one rank, or on several with --set parallel.mode=sync")

    # ---- the notes of the mode, whatever the scheme (Scheme.settings_without_effect)
    @classmethod
    def mode_notes(cls, job, note, changed):
        par = job.parallel
        servers = par.ps_ranks
        note(["mode"], f"{par.mode} has no effect on 1 rank: parameter servers need at least "
             f"{servers + 1} ranks (ps_ranks {servers} and a worker), so this rank trains "
             f"alone with the plain {job.solver.type} solver (start mpiexec -n {servers + 1} or "
             "more for servers)")
        changed.difference_update(SERVER_KEYS)

    @classmethod
    def many_rank_notes(cls, job):
        par = job.parallel
        if asynchronous(par.mode) and par.max_staleness == 0:
            return ["note: parallel.mode async with max_staleness 0 lets no worker run "
                    "ahead, so it runs as mode sync_ps (synchronous SGD: one update per "
                    "round of gradients); set max_staleness >= 1 for asynchronous updates"]
        return []

    @classmethod
    def why_no_buckets(cls, par):
        return f"mode {par.mode} sends gradients to parameter servers"

    @classmethod
    def served_key_notes(cls, par, note):
        if lockstep(par.mode):
            note(["max_staleness"], "applies to mode async only; mode sync_ps is synchronous, "
                 "so it has no effect")

    # ---- the state the servers hold
    def whole_solver_shapes(self, graphs):
        """A worker's view of the momenta its servers hold (train/ps_server.py
        loads them from a --resume checkpoint, every served parameter's):
        checked on the workers as well (train/checkpoints.py check_for_net),
        so a checkpoint whose momentum holds NaN, or has another shape, is
        found on every rank alike (one message by rank 0), not by a server
        alone (its own ``error: rank R: ...`` and an abort of the job; one
        line per server). Nothing on one rank (no servers)."""
        plan = getattr(graphs.composition, "server_plan", None)
        if plan is None:
            return {}
        blobs = graphs.graph.blobs
        return {(p, "momentum"): (tuple(blobs[p].shape), blobs[p].dtype) for p in plan["order"]}

    # ---- what rank 0 holds of the servers' state (``plan``'s figures)
    # A save (and, in async, a test pass) brings the servers' state to rank 0
    # (train/ps_worker.py): each server's momenta (async: and weights) pickled
    # (async_server.send_state), received one server after the other
    # (ps_server.recv_state: the message, then its arrays), put in the
    # workspace for the save and let go after it (async: the agreement keeps
    # the last sync's momenta until the next); in async the weights then go
    # from rank 0 to every worker (one allgather of the pickled weights,
    # World.allgather_object: rank 0's pickle, and on every worker the
    # receive buffer, the bytes of rank 0's part copied out of it and the
    # arrays unpickled from them).
    @staticmethod
    def _server_bytes(graphs):
        """{server: bytes of the weights it owns} (its momenta are as many),
        or None (one rank: no servers)."""
        plan = getattr(graphs.composition, "server_plan", None)
        if plan is None:
            return None
        out = dict.fromkeys(plan["servers"], 0)
        for p, s in plan["owner"].items():
            out[s] += graphs.graph.blobs[p].nbytes
        return out

    def held_bytes(self, graphs):
        owned = self._server_bytes(graphs)
        if owned is None or graphs.layout.replica != 0 or \
                lockstep(graphs.composition.server_plan["mode"]):
            return super().held_bytes(graphs)
        return sum(owned.values())  # async rank 0: the last sync's momenta

    def save_bytes(self, graphs, everyone):
        own = super().save_bytes(graphs, everyone)
        owned = self._server_bytes(graphs)
        if owned is None:
            return own
        every = sum(owned.values())
        both = 1 if lockstep(graphs.composition.server_plan["mode"]) else 2
        if graphs.layout.replica != 0:
            return own + (0 if both == 1 else 3 * every)
        got, most = 0, 0
        for s in sorted(owned):  # recv_state: the message and its arrays, the earlier kept
            most = max(most, got + 2 * both * owned[s])
            got += both * owned[s]
        if both == 2:  # then the allgather: the weights received, their pickle, and
            # the receive buffer, bytes and arrays (the momenta received are counted
            # in ``held_bytes``: the previous sync's let go once these are in)
            most = max(most, 5 * every)
        return own + most

    # ---- reporting
    def scheme_lines(self, trainer, composition):
        par = trainer.job.parallel
        workers, servers = self.ranks["workers"], self.ranks["servers"]
        how = ("the servers average each round" if lockstep(par.mode) else
               f"max_staleness {par.max_staleness}")
        return [("scheme", f"parameter servers (mode {par.mode}, {how}): "
                 f"{ranks_word(workers)} {'are workers' if len(workers) > 1 else 'is the worker'}, "
                 f"{ranks_word(servers)} {'are servers' if len(servers) > 1 else 'is the server'} "
                 "holding the parameters (sharded)")] + \
            Scheme.scheme_lines(self, trainer, composition)

    def startup_lines(self, trainer, composition):
        if self.ranks is None:  # one rank: no servers
            return Scheme.startup_lines(self, trainer, composition)
        return self.scheme_lines(trainer, composition)
