"""Answers kept by content while a command that computes many of them runs.

``plan --choose`` composes the same net for many settings and ranks: graphs
of one content ask for the same dependencies (graph/core.Graph.dependencies)
and memory plans of one content for the same colouring
(runtime/memory_plan.py). A ``SharedAnswers`` keeps the last ``size``
answers by a key of what they are computed from, only while it is
``opened()``, so that a run holds no answer beyond its own objects'.
"""
import contextlib


class SharedAnswers:
    """The last ``size`` answers by content key, kept while ``opened()``
    (nested openings share the outermost's), the most recently asked last."""

    def __init__(self, size, max_bytes=None, weigh=None):
        self.size = size
        #: with ``weigh`` ((key, answer) -> bytes, an estimate of what the
        #: two hold): the older answers are dropped while those kept weigh
        #: more than ``max_bytes`` (the newest is always kept; None: no
        #: bound but the count)
        self.max_bytes = max_bytes
        self.weigh = weigh
        self._kept = None
        self._bytes = {}

    @property
    def kept_bytes(self):
        """What the kept answers weigh (0 without ``weigh``)."""
        return sum(self._bytes.values())

    @property
    def is_open(self):
        return self._kept is not None

    @contextlib.contextmanager
    def opened(self):
        outer = self._kept
        if outer is None:
            self._kept, self._bytes = {}, {}
        try:
            yield
        finally:
            if outer is None:
                self._kept, self._bytes = None, {}

    def answer(self, key, compute):
        """``compute()``, or (while open) the answer kept for ``key()``:
        ``key`` is called only while open (a key may cost)."""
        kept = self._kept
        if kept is None:
            return compute()
        raw = key()
        k = _Key(raw)
        if k in kept:
            value = kept.pop(k)
        else:
            value = compute()
            while len(kept) >= self.size:
                self._drop_oldest()
            if self.weigh is not None:
                self._bytes[k] = self.weigh(raw, value)
                while kept and self.max_bytes is not None and self.kept_bytes > self.max_bytes:
                    self._drop_oldest()
        kept[k] = value  # the most recently asked: last
        return value

    def _drop_oldest(self):
        oldest = next(iter(self._kept))
        del self._kept[oldest]
        self._bytes.pop(oldest, None)


class _Key:
    """A key with its hash taken once: the dict's test, pop and store hash
    it once, not three times (a key is a graph's whole content, a tuple
    of ~40,000 tuples at 32 micro-batches of GPT-2 124M: ~10 ms a hash)."""

    __slots__ = ("value", "hash")

    def __init__(self, value):
        self.value = value
        self.hash = hash(value)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        if type(other) is _Key:
            return self.hash == other.hash and self.value == other.value
        return self.value == other   # a raw key: the kept keys read as the keys given
