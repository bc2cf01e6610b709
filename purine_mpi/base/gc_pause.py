"""Python's cyclic garbage collector paused while a command builds and
drops many graphs at once.

``plan`` composes each rank's graphs and their memory plans: millions of
small objects (ops, blobs, their lists and dicts, bit sets), nearly all
freed by their reference counts. The collector's full passes walk every
live object each time the heap has grown by a quarter: on ``plan
jobs/gpt2_124m.yaml --np 8`` (32 micro-batches, 19,337 ops a graph) 25
full passes took 3.4 of the run's 16.7 CPU seconds and freed next to
nothing (the peak resident bytes were the same without them, 476 MB).
"""
import contextlib
import gc


@contextlib.contextmanager
def collections_paused():
    """Within it, no automatic cyclic collection (reference counting frees
    as ever); the collector's state before it is restored on the way out,
    an exception's too. Nested: the outermost restores it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
