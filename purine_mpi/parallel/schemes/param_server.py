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
from ...base.errors import UserError
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
    micro_batches = False
    nccl = False
    #: {"workers": [...], "servers": [...]} of a worker's part (WorkerScheme), else None
    ranks = None

    def server_ranks(self):
        return self.ranks

    def compose(self, graph, grads, job, world):
        """On one rank, the replica as scheme data composes it; on several the
        workers compose through ``WorkerScheme`` (train/trainer.run_param_server)."""
        from .steps import accumulate, clipped
        accumulate(graph, grads, job)
        if world.size == 1:
            return clipped(Composition(graph.validate(), self.layout(job, world)), job, world)
        raise UserError(f"{job.path}: key 'parallel.mode': mode "
                        f"'{job.parallel.mode}' runs through the parameter-server trainer")

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
