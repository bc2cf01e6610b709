"""Which dispatcher runs a graph: ``make_dispatcher``.

The dispatchers are layered, each module importing only those below it::

    factory.py             make_dispatcher: picks one of the below
    streams_dispatcher.py  StreamDispatcher: GPU ops on CUDA streams
    dispatcher.py          EventDispatcher, SerialDispatcher, Profiler

so that nothing below this module needs to know which dispatchers exist.
"""
import os

from ..errors import UserError
from .dispatcher import EventDispatcher, SerialDispatcher
from .streams_dispatcher import StreamDispatcher

#: the values of ``kind`` (and of the environment variable PURINE_DISPATCHER)
KINDS = ("event", "serial", "stream")


def make_dispatcher(graph, kind=None, **kw):
    """``kind`` is 'event' (default), 'serial' or 'stream'; env PURINE_DISPATCHER
    overrides. 'event' on a graph with GPU ops (location device >= 0) is the
    CUDA-stream dispatcher (runtime/streams_dispatcher.py)."""
    kind = os.environ.get("PURINE_DISPATCHER", kind or "event")
    if kind not in KINDS:
        raise UserError(f"PURINE_DISPATCHER must be 'event', 'serial' or 'stream', got '{kind}'")
    if kind == "serial":
        return SerialDispatcher(graph, **kw)
    if kind == "stream" or on_gpu(graph):
        return StreamDispatcher(graph, **kw)
    return EventDispatcher(graph, **kw)


def on_gpu(graph):
    """Whether any op or blob of ``graph`` lives on a GPU (device >= 0)."""
    return any(n.location.device >= 0 for n in list(graph.ops.values()) +
               list(graph.blobs.values()))
