"""The one YAML reader of the package: ``read_yaml(text, name)`` for every
YAML the program reads from the user (the job file, ``--set`` values, a
run's ``config.yaml``, the config text inside a checkpoint). Safe YAML
(``yaml.SafeLoader``, plus ``1e-3`` read as a number), made strict and
bounded:

- a key given twice in one mapping is refused (``YamlRefused``) naming the
  line of each and the dotted key path: plain YAML keeps the second
  silently, so a second ``solver:`` block would replace the first;
- nesting deeper than ``MAX_DEPTH`` levels is refused at the line where it
  happens (counted while composing, so no ``RecursionError``; values that
  aliases paste into others count at their expanded depth);
- a string holding a surrogate (a ``"\\ud800"`` escape; YAML does not join
  a pair into one character) is refused at its line: every file the run
  writes is UTF-8, which cannot hold one;
- anchors and aliases (``&name`` / ``*name``) stay allowed: sharing a
  value is what they are for, and the key checks advise them; but the
  values that aliases repeat may add at most ``MAX_ALIAS_NODES`` nodes to
  what the text itself holds, and an alias inside its own anchor is
  refused. A "billion laughs" file (a few lines of nested aliases that
  expand to 10^9 values) is refused in milliseconds, before anything is
  built;
- the YAML 1.1 number forms that YAML 1.2 reads otherwise are refused
  naming the key and line: a base-60 number (``max_iter: 1:20`` is 80 in
  YAML 1.1, the text '1:20' in 1.2) and an integer with a leading zero
  (``024`` is octal 20 in YAML 1.1, 24 in 1.2; ``00`` to ``07`` read the
  same in both and load), and a binary one (``0b101`` is 5 in YAML 1.1,
  the text '0b101' in 1.2). PyYAML reads them the 1.1
  way without a word, so a job would train with a value its author never
  wrote; quoted, they stay text.

The limits are checked on the composed node graph (aliases are shared
nodes there, so the check costs the size of the text), before Python
objects are made.
"""
import bisect
import re

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

#: deepest nesting of mappings and lists (a job file needs about 6)
MAX_DEPTH = 64
#: nodes that aliases may add to those written in the text
MAX_ALIAS_NODES = 100_000

_MERGE = "tag:yaml.org,2002:merge"
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
#: YAML 1.1's base-60 numbers (PyYAML's resolver: 1:20 is 80, 1:20.5 is 80.5)
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
#: YAML 1.1's octal integers with a leading 0 (024 is 20; 1.2 reads 24)
_LEADING_ZERO = re.compile(r"^[-+]?0[0-7_]+$")
#: YAML 1.1's binary integers (0b101 is 5; 1.2's core schema reads the text '0b101')
_BINARY = re.compile(r"^[-+]?0b[0-1_]+$")
#: a surrogate code point, which a "\ud800" escape makes and UTF-8 cannot encode
_SURROGATE = re.compile("[\ud800-\udfff]")


class YamlRefused(yaml.MarkedYAMLError):
    """Well-formed YAML refused by a limit of this reader (a key given twice,
    too deep, too many aliased values); ``problem_mark`` is where."""

    def __init__(self, problem, mark):
        super().__init__(problem=problem, problem_mark=mark)


def _at(loader, mark):
    """``NAME:LINE`` of a mark (``column C`` of a nameless one-line text, a
    ``--set`` value; else ``line L, column C``)."""
    if loader.source:
        return f"{loader.source}:{_line(mark)}"
    buffer = mark.buffer
    if buffer is not None and mark.line == 0 and "\n" not in buffer.rstrip("\0\n"):
        return f"column {mark.column + 1}"
    return f"line {_line(mark)}, column {_column(mark)}"


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the checks of the module docstring, which
    reads ``1e-3`` and ``5E8`` (YAML 1.2 floats without a dot) as numbers,
    as every other YAML reader does: a string where a number is expected is
    then always a quoted one, and refused."""

    def __init__(self, stream, source=None):
        super().__init__(stream)
        self.source = source  # the file's name, for the messages
        self._depth = 0
        self._aliases = []  # (mark, anchor name, node) of each alias in the text

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            self._aliases.append((event.start_mark, event.anchor, node))
            return node
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels of mappings and "
                                  f"lists at {_at(self, mark)} (a job file needs a handful)",
                                  mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            self._check(node)
        return node

    # ------------------------------------------------------------- checks
    def _check(self, root):
        """Duplicate keys, the expanded size and depth, alias cycles: one
        walk over the distinct nodes (an alias is the node it names)."""
        size, depth, active = {}, {}, set()
        stack = [(root, (), False)]
        while stack:
            node, path, done = stack.pop()
            nid = id(node)
            kids = _children(node)
            if done:
                active.discard(nid)
                size[nid] = 1 + sum(size[id(k)] for k, _ in kids)
                depth[nid] = 1 + max((depth[id(k)] for k, _ in kids), default=0)
                if depth[nid] > MAX_DEPTH:
                    raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels of mappings and "
                                      f"lists once its aliases are pasted in, at "
                                      f"{_at(self, node.start_mark)}", node.start_mark)
                continue
            if nid in size:
                continue
            if nid in active:
                raise YamlRefused(f"an alias inside the value of its own anchor at "
                                  f"{_at(self, node.start_mark)} (a value that contains "
                                  "itself)", node.start_mark)
            active.add(nid)
            if isinstance(node, ScalarNode) and _SURROGATE.search(node.value):
                raise YamlRefused(f"a string at {_at(self, node.start_mark)} holds a UTF-16 "
                                  "surrogate (a \\ud800 to \\udfff escape: YAML does not "
                                  "join a pair of them into one character), which no UTF-8 "
                                  "file (log, checkpoint, trace) can hold; write the "
                                  "character itself or its 8-digit \\U escape",
                                  node.start_mark)
            if isinstance(node, MappingNode):
                self._no_duplicates(node, path)
            elif isinstance(node, ScalarNode):
                self._no_yaml11_number(node, path)
            stack.append((node, path, True))
            stack.extend((k, path + (step,), False) for k, step in reversed(kids))
        extra = size[id(root)] - len(size)
        if extra > MAX_ALIAS_NODES:
            mark, anchor, node = max(self._aliases, key=lambda a: size.get(id(a[2]), 0))
            raise YamlRefused(f"the aliases of this document repeat {extra} values in all "
                              f"(*{anchor} at {_at(self, mark)} alone repeats "
                              f"{size[id(node)]}), over the "
                              f"limit of {MAX_ALIAS_NODES} (nested aliases, a 'billion "
                              "laughs'?); write the values out or alias fewer", mark)

    def _no_yaml11_number(self, node, path):
        """Refuse a plain scalar that YAML 1.1 and 1.2 read as different
        values (the module docstring): PyYAML would take the 1.1 one."""
        if node.style is not None or node.tag not in (_INT, _FLOAT):
            return  # quoted (text) or not a number
        text = node.value
        if _SEXAGESIMAL.match(text):
            value = self.construct_object(node)
            why = (f"is a base-60 number in YAML 1.1 ({value:g}) and the text {text!r} in "
                   f"YAML 1.2; write the number you mean, or quote it where it is text")
        elif _LEADING_ZERO.match(text):
            value = self.construct_object(node)
            decimal = int(text.replace("_", ""), 10)
            if value == decimal:  # 00, 07, -05: the same number in both versions
                return
            why = (f"is octal in YAML 1.1 ({value}) and decimal in YAML 1.2 ({decimal}); "
                   "write it without the leading 0, or quote it where it is text")
        elif _BINARY.match(text):
            value = self.construct_object(node)
            why = (f"is binary in YAML 1.1 ({value}) and the text {text!r} in YAML 1.2; "
                   f"write {value} if you mean the number, or quote it where it is text")
        else:
            return
        dotted = ".".join(str(p) for p in path)
        key = f"key '{dotted}': " if dotted else ""
        raise YamlRefused(f"{key}{text} at {_at(self, node.start_mark)} {why}", node.start_mark)

    def _no_duplicates(self, node, path):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE or not isinstance(key_node, ScalarNode):
                continue  # '<<' merges are overridden by design; odd keys: the constructor's
            key = self.construct_object(key_node)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue
            if first is not key_node:
                dotted = ".".join(str(p) for p in path + (key,))
                raise YamlRefused(f"key '{dotted}' is given twice, at "
                                  f"{_at(self, first.start_mark)} and at "
                                  f"{_at(self, key_node.start_mark)} (YAML would keep the "
                                  "second silently); keep one", key_node.start_mark)


def _children(node):
    """[(child node, its step in the key path)] of a node."""
    if isinstance(node, SequenceNode):
        return [(k, i) for i, k in enumerate(node.value)]
    if isinstance(node, MappingNode):
        out = []
        for key_node, value_node in node.value:
            step = key_node.value if isinstance(key_node, ScalarNode) else "?"
            out.append((key_node, step))
            out.append((value_node, step))
        return out
    return []


StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def read_yaml(text, source=None):
    """The one document of ``text`` (a string or a file), read by
    ``StrictLoader``; ``source`` names it in the messages (``FILE:LINE``).
    Raises ``yaml.YAMLError`` (``YamlRefused`` for a
    refused limit) for the caller to turn into its own error."""
    loader = StrictLoader(text, source)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_lines(text, source=None):
    """``read_yaml`` with the line of each key: ``(data, lines)``, ``lines``
    a dict from a key path (a tuple of strings: a mapping's keys as written,
    a list's indices as ``"3"``; a key that is not a string, ``yes:`` or
    ``1.5:``, as ``str`` of its value, as an error names it) to the 1-based
    line where that key (or list item) is written, as an editor counts
    lines (only line feeds and carriage returns end one: PyYAML also counts
    NEL, U+2028 and U+2029, which a quoted string may hold). ``data`` is
    what ``read_yaml`` returns (plain dicts, lists, strings, numbers): the
    lines lie beside it, never in it. A key that a ``<<`` merge or an alias
    brings has the line of the text it comes from: what lies under an
    alias's value is recorded once, at its anchor (the first place the
    text holds it), and ``lines.aliases`` maps the path of each later use
    to the anchor's path (``key_line`` in job/config.py follows it)."""
    loader = StrictLoader(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, KeyLines()
        data = loader.construct_document(node)  # flattens the '<<' merges in the nodes
        return data, key_lines(node, _line_counter(text), loader.construct_object)
    finally:
        loader.dispose()


class KeyLines(dict):
    """``read_yaml_lines``' table: key path -> line; ``aliases``: the path
    of an alias's later use -> the path where its anchor's value is."""

    def __init__(self, *args):
        super().__init__(*args)
        self.aliases = {}


_STR = "tag:yaml.org,2002:str"
#: what PyYAML counts as a line break and an editor does not
_ODD_BREAKS = re.compile("[\x85\u2028\u2029]")


def _line_counter(text):
    """mark -> its 1-based line as an editor counts it in ``text``."""
    if not isinstance(text, str) or not _ODD_BREAKS.search(text):
        return lambda mark: mark.line + 1
    starts = _line_starts(text)
    return lambda mark: bisect.bisect_right(starts, mark.index)


def _line_starts(text):
    """The index where each line of ``text`` begins, as an editor counts
    lines (a line feed, a carriage return, or both, end one)."""
    return [0] + [m.end() for m in re.finditer(r"\r\n|\r|\n", text)]


def _line(mark):
    """The 1-based line of ``mark`` as an editor counts it (``_line_counter``),
    for a message."""
    return _place(mark)[0]


def _column(mark):
    """The 1-based column of ``mark`` in its line as an editor counts it."""
    return _place(mark)[1]


def _place(mark):
    """(line, column) of ``mark``, 1-based, as an editor counts them: the
    text it lies in (PyYAML keeps it whole in ``mark.buffer``) is read
    again where it holds a NEL, U+2028 or U+2029."""
    buffer = getattr(mark, "buffer", None)
    if not isinstance(buffer, str) or not _ODD_BREAKS.search(buffer):
        return mark.line + 1, mark.column + 1
    starts = _line_starts(buffer)
    line = bisect.bisect_right(starts, mark.index)
    return line, mark.index - starts[line - 1] + 1


def key_lines(root, line_of=lambda mark: mark.line + 1, construct=None):
    """The ``lines`` table (``KeyLines``) of ``read_yaml_lines`` for a
    composed (and constructed) node graph: one visit per distinct node, in
    the order of the text, so that an anchor's value is recorded where it
    is written, not where an alias repeats it. ``construct``: a key node ->
    its value, for the keys that are not strings."""
    lines, seen = KeyLines(), {}
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            if isinstance(node, (SequenceNode, MappingNode)) and seen[id(node)] != path:
                lines.aliases[path] = seen[id(node)]  # what it holds: there
            continue
        seen[id(node)] = path
        if isinstance(node, SequenceNode):
            entries = [(str(i), item, item) for i, item in enumerate(node.value)]
        elif isinstance(node, MappingNode):
            last = {}  # the last of a key given twice (a merged one, then its own)
            for key_node, value_node in node.value:
                if isinstance(key_node, ScalarNode) and key_node.tag != _MERGE:
                    step = key_node.value
                    if key_node.tag != _STR and construct is not None:
                        try:
                            step = str(construct(key_node))  # yes: 'True', ~: 'None'
                        except yaml.YAMLError:
                            pass
                    last[step] = (key_node, value_node)
            entries = [(step, key, value) for step, (key, value) in last.items()]
        else:
            continue
        for step, marked, child in reversed(entries):  # the first popped first
            lines[path + (step,)] = line_of(marked.start_mark)
            stack.append((child, path + (step,)))
    return lines


def where(error):
    """``line L, column C: problem`` of a YAML error (the ``started at`` line
    of its context too), for a one-line message."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    mark = error.problem_mark or error.context_mark
    at = f"line {_line(mark)}, column {_column(mark)}: " if mark else ""
    what = error.problem or ""
    if error.context:
        start = error.context_mark
        started = (f" (started at line {_line(start)}, column {_column(start)})"
                   if start is not None and start is not mark else "")
        what = f"{error.context}{started}: {what}"
    return f"{at}{what}"
