"""Which dispatcher runs a graph: ``make_dispatcher``; the memory it runs
in: ``planned_workspace``.

Every dispatcher is the scheduling core (``dispatcher.Dispatcher``) with
an executor; each module imports only those below it::

    factory.py             make_dispatcher: picks one of the below
    cuda_graph.py          GraphDispatcher: segments captured as CUDA graphs
    streams_dispatcher.py  StreamDispatcher: GPU ops on CUDA streams
    dispatcher.py          EventDispatcher (CPU thread pool), SerialDispatcher
    executors.py           the executors' interface, the thread pool, the serial twin
    scheduler.py           the scheduling rule (also the scaling simulator's)

so that nothing below this module needs to know which dispatchers exist.
"""

from ..base import env
from ..base.errors import UserError
from .cuda_graph import GraphDispatcher
from .dispatcher import EventDispatcher, SerialDispatcher
from .memory_plan import device_plans, plan_memory
from .streams_dispatcher import StreamDispatcher
from .workspace import Workspace, window_arrays

#: the values of ``kind`` (and of the environment variable PURINE_DISPATCHER)
KINDS = ("event", "serial", "stream")


def make_dispatcher(graph, kind=None, cuda_graph=True, log=None, **kw):
    """``kind`` is 'event' (default), 'serial' or 'stream'; env PURINE_DISPATCHER
    overrides. 'event' on a graph with GPU ops (location device >= 0) is the
    CUDA-stream dispatcher: with ``cuda_graph`` (the config key, default
    true) the one that captures and replays CUDA graphs
    (runtime/cuda_graph.py, its notes go to ``log``), else the eager one
    (runtime/streams_dispatcher.py). ``cuda_graph`` means nothing on a CPU.
    ``defer_tail`` (``parallel.defer_update``) is the CPU event dispatcher's:
    the others end every iteration with every op done."""
    defer_tail = kw.pop("defer_tail", False)  # the CPU event dispatcher's alone
    kind = dispatcher_kind(kind)
    if kind == "serial":
        return SerialDispatcher(graph, **kw)
    gpu = on_gpu(graph)
    if gpu and cuda_graph:
        return GraphDispatcher(graph, log=log, **kw)
    if kind == "stream" or gpu:
        return StreamDispatcher(graph, **kw)
    return EventDispatcher(graph, defer_tail=defer_tail, **kw)


def dispatcher_kind(kind=None):
    """The kind of dispatcher ``make_dispatcher`` makes for ``kind``:
    PURINE_DISPATCHER first, then ``kind``, then 'event' (EnvError or
    UserError when not one of KINDS)."""
    kind = env.get("PURINE_DISPATCHER") or kind or "event"
    if kind not in KINDS:
        raise UserError(f"dispatcher must be 'event', 'serial' or 'stream', got '{kind}'")
    return kind


def on_gpu(graph):
    """Whether any op or blob of ``graph`` lives on a GPU (device >= 0)."""
    return any(n.location.device >= 0 for n in list(graph.ops.values()) +
               list(graph.blobs.values()))


def memory_plans(graph, keep=(), skip=(), order_ops=True):
    """(the host's plan, {GPU device: its plan}) of ``graph``, as ``train``
    lays it out (runtime/memory_plan.py). With ``order_ops`` the plans may
    add control edges: between the ops of one stream on each GPU, and
    between the ops of one CPU thread only where the CPU dispatchers run
    the graph (a GPU graph's host blobs are few)."""
    host = plan_memory(graph, keep=keep, skip=skip, order_ops=order_ops and not on_gpu(graph))
    return host, device_plans(graph, keep=keep, skip=skip, order_ops=order_ops)


def planned_workspace(graph, planned=True, keep=(), shared=None, arena=None, plans=None,
                      room=None):
    """The workspace ``train`` runs ``graph`` in. With ``planned`` (the
    config's ``memory_plan``) the transient blobs of the host and of each
    GPU share one arena per device (runtime/memory_plan.py); ``keep``: what
    the host reads besides losses and metrics; ``shared``, ``arena``: as
    ``Workspace`` takes them, and ``room`` too; the plans are those of ``memory_plans``, or
    ``plans`` (host, {device: plan}) made already for the same graph, keep
    and shared blobs (runtime/footprint.py: the start-up memory check)."""
    # blobs in window memory (parallel.transport) are owned by the windows
    shared = {**window_arrays(graph), **dict(shared or {})}
    if not planned:
        return Workspace(graph, shared=shared, arena=arena)
    plan, devices = plans or memory_plans(graph, keep=keep, skip=shared or ())
    return Workspace(graph, shared=shared, plan=plan, arena=arena, device_plans=devices,
                     room=room)
