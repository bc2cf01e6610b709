"""Error types. A ``UserError`` is the user's to fix (bad config, missing file,
shape mismatch): the CLI prints its message as one paragraph and exits 2,
with no traceback. Anything else is a bug or a runtime failure. ``excerpt(value)`` is how a
message quotes a value the user gave: its repr, cut to a short excerpt with
the whole size when it is long. ``one_line(text)`` is how text a file
holds (an HDF5 name or attribute) is shown: control characters escaped, so
a crafted file writes neither terminal escapes nor lines of its own.
``write_line(text)`` writes one whole line to stderr in one write (several
ranks' lines never glue).
"""
import re
import os
import sys

#: the exit status when MPI itself cannot start (MPI_Init fails: comm/mpi_init.py)
MPI_INIT_FAILED = 70


class UserError(Exception):
    """An error the user can act on; the message names the file/key/node."""

    exit_code = 2


class DataSpecError(UserError):
    """A data spec's value that does not fit its data (a split the file
    lacks, a crop larger than the samples, a mean of the wrong length):
    ``key`` is the spec's key (``split``, ``crop_size``); the graph's
    builder (job/replica.py) names the config and ``data.<phase>.<key>``."""

    def __init__(self, message, key):
        super().__init__(message)
        self.key = key


class InitMismatch(UserError):
    """A weights file that does not fit the net (parameters missing, a shape
    that differs): ``message`` ends with ``hint``, train's way out (``--init-skip
    LAYER``); ``for_weights()`` is the error for the commands that evaluate
    given weights (test, predict, export), where a fresh layer is no way out."""

    def __init__(self, message, hint):
        self.message, self.hint = message, hint
        super().__init__(f"{message}{hint}")

    def for_weights(self):
        return UserError(f"{self.message}: the weights belong to another net; give the "
                         "config they were trained with")


class ConfigError(UserError):
    """Bad configuration: ``ConfigError(path, key, message)``. ``also``:
    the other keys a rule between keys read (``solver.base_lr`` for the
    refused ``solver.min_lr`` above it), so that a refusal a ``--set`` of
    one of them caused names that ``--set`` (job/config.py). ``line``: the
    line of the file where the key (or, for a missing key, its nearest
    parent) is written, which the message puts after the file's name
    (``job.yaml:17: key 'net[3].kernel_size': ...``); the checks do not
    know it, the loader adds it (``at_line``, job/config.py)."""

    def __init__(self, path, key, message, also=(), line=None):
        message = _yaml_bool_hint(key, message)
        self.path, self.key, self.problem = path, key, message
        self.also = tuple(also)
        self.line = line if path else None
        # the key (and file) as one printable line: a YAML key may hold a line
        # break or an escape sequence ("a\nb": 1), which the one-line message
        # would print as it is, acting on the terminal
        where = (f"{one_line(path)}:{line}: " if self.line else f"{one_line(path)}: ") \
            if path else ""
        keytxt = f"key '{one_line(excerpt(key, quote=False))}': " if key else ""
        super().__init__(f"{where}{keytxt}{message}")

    def at_line(self, line):
        """This error with ``line`` after the file's name (the other
        attributes a caller set kept: ``shape_error``)."""
        new = ConfigError(self.path, self.key, self.problem, self.also, line)
        for name, value in vars(self).items():
            if name not in vars(new):
                setattr(new, name, value)
        return new


#: "got False" / "got bool True" in a message: a YAML boolean where the key wants another type
_GOT_BOOL = re.compile(r"\bgot (?:bool )?((True|False))\b(?! \(YAML)")
#: "got [True, 'label']": a YAML boolean in a list the message shows (group
#: 1: the list, one level; a mapping's booleans may be its values: numbers)
_GOT_BOOL_INSIDE = re.compile(r"\bgot (\[[^\[\]{}]*?(?<![\w'\"])(True|False)(?![\w'\"])"
                              r"[^\[\]{}]*\])(?! \(YAML)")
#: the plain words YAML (1.1, PyYAML's) reads as each boolean
_BOOL_WORDS = {"True": ("yes", "on", "true"), "False": ("no", "off", "false")}


def _yaml_bool_hint(key, message):
    """``message`` with a word on a boolean where the key expects text:
    YAML reads an unquoted ``no``, ``off``, ``yes``, ``on`` as a boolean
    (``name: no``, ``pool: off``), and "got False" alone leaves the user
    wondering where False came from."""
    found = _GOT_BOOL.search(str(message)) if key else None
    end = found.end() if found is not None else None
    if found is None and key:  # in a list: [True, 'label']
        found = _GOT_BOOL_INSIDE.search(str(message))
        end = found.end(1) if found is not None else None
    if found is None or re.search(r"\b(number|integer)", message[:found.start()]):
        return message  # a boolean where a number is expected: no text to quote
    words = _BOOL_WORDS[found.group(2)]
    name = re.sub(r"\[(\d+)\]", r".\1", str(key)).split(".")[-1]
    hint = (f" (YAML read an unquoted `{words[0]}`, `{words[1]}` or `{words[2]}` as the "
            f"boolean {found.group(2)}: quote the text you mean, e.g. {name}: '{words[0]}' "
            f"or {name}: '{words[1]}')")
    return message[:end] + hint + message[end:]


class MemoryTooSmall(UserError):
    """A job whose footprint (runtime/footprint.py) exceeds the memory its
    rank has: ``train`` refuses it before allocating (tools/plan.py)."""


class GraphError(UserError):
    """An invalid graph: unknown op type, dangling input, cycle, double writer."""


class ShapeError(GraphError):
    """Shape inference failed; the message names the op and the blobs
    (``op``: the op's name, where inference names it, so that a net's
    builder can name the layer and key that made it)."""

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op


class StallError(RuntimeError):
    """A communication op did not complete within the stall timeout."""


class StoppedWhileStalled(StallError):
    """A cancel (SIGTERM, ...) ended a wait on a peer that did not come:
    no checkpoint (one needs every rank); ``exit_code`` 128 + the signal."""

    def __init__(self, message, signal_name):
        import signal
        super().__init__(message)
        self.signal_name = signal_name
        self.exit_code = 128 + int(getattr(signal, signal_name))


class OpError(RuntimeError):
    """An op's kernel raised; carries the op name so every rank can report it."""

    def __init__(self, op, cause, rank=0):
        self.op, self.cause, self.rank = op, cause, rank
        super().__init__(f"rank {rank}: op '{op.name}' ({op.op_type}) failed: "
                         f"{type(cause).__name__}: {cause}")


#: how many characters of a value a message quotes at most
EXCERPT_CHARS = 120

#: characters a terminal acts on rather than prints, as their escapes: C0
#: and C1 controls (ESC, CSI \x9b, \r, \n, NUL...), DEL, the Unicode line
#: and paragraph separators and the bidirectional overrides and isolates
#: (text that shows in another order than it reads)
_CONTROL = {c: repr(chr(c))[1:-1] if c < 0x100 else f"\\u{c:04x}"
            for c in (*range(0x20), *range(0x7f, 0xa0), 0x2028, 0x2029,
                      *range(0x202a, 0x202f), *range(0x2066, 0x206a))}


def one_line(text):
    """``text`` (a name or value read from a file) as one printable line:
    control characters as escapes (``\\n``, ``\\x1b``, ``\\u202e``),
    everything else as it is; the bytes of a name that is not UTF-8 (h5py's
    surrogate escapes) as ``\\xe9``."""
    text = str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate no bytes stand for
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.translate(_CONTROL)


def excerpt(value, limit=EXCERPT_CHARS, quote=True):
    """``repr(value)`` (``str`` with ``quote=False``) for a message, at most
    ``limit`` characters: a longer one is cut, with ``...`` and its whole
    size (``(a list of 1000000 items)``). Built piece by piece, so a huge or
    deeply nested value costs no more than the excerpt."""
    pieces, length = [], 0
    for piece in (_pieces(value, 0) if quote else [str(value)]):
        pieces.append(piece)
        length += len(piece)
        if length > limit:
            return "".join(pieces)[:limit] + f"... ({_size(value)})"
    return "".join(pieces)


def _size(value):
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"a mapping of {len(value)} keys"
    if isinstance(value, (str, bytes)):
        return f"{len(value)} characters"
    return type(value).__name__


def _pieces(value, depth):
    """The repr of ``value`` in pieces (a container's items one by one)."""
    if isinstance(value, (list, tuple, dict)) and depth >= 32:
        yield "[...]" if not isinstance(value, dict) else "{...}"
    elif isinstance(value, dict):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _pieces(k, depth + 1)
            yield ": "
            yield from _pieces(v, depth + 1)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "[" if isinstance(value, list) else "("
        for i, v in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(v, depth + 1)
        yield "]" if isinstance(value, list) else ("," if len(value) == 1 else "") + ")"
    elif isinstance(value, str) and len(value) > 4 * EXCERPT_CHARS:
        yield repr(value[:4 * EXCERPT_CHARS])[:-1]  # enough for any excerpt, never closed
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1000:
        yield f"<an integer of {value.bit_length()} bits>"
    else:
        yield repr(value)


def write_line(text, quiet=True):
    """``text`` and its newline to stderr in one ``os.write`` of the whole
    line, after what Python's stream still holds. Lines of several ranks (or
    threads) that share the launcher's pipe then mix only at line
    boundaries: a pipe write under PIPE_BUF (4096) bytes is atomic, where
    ``print`` writes the text and the newline apart (two writes without
    line buffering: ``python -u``, PYTHONUNBUFFERED) and a long line in
    8 KiB pieces. No buffered stream: a signal may have come in the middle
    of a print. ``quiet``: an OSError (a closed pipe) is dropped."""
    data = (text.rstrip("\n") + "\n").encode("utf-8", "replace")
    try:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        while data:
            data = data[os.write(2, data):]
    except OSError:
        if not quiet:
            raise
