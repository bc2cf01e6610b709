"""Protobuf text format (Caffe's ``.prototxt``): a tokenizer and a
recursive-descent parser, checked against a message schema.

    message := field*
    field   := NAME ':' scalar | NAME ':' '[' scalar (',' scalar)* ']'
             | NAME ':'? '{' message '}' | NAME ':'? '<' message '>'
    scalar  := NUMBER | STRING | IDENTIFIER (an enum value, true/false)

``parse(text, schema, root, path)`` returns a ``Message``: its ``fields``
are ``Field(name, value, line)`` in file order, a value being a number, a
string, an ``Enum`` (a bare identifier) or a nested ``Message``. Every error
is a ``PrototxtError`` that names the file and line. The schema (see
``caffe_schema``) maps each message type to its fields; a field it does not
list is an error, so a typo never passes silently.
"""
import re
from collections import namedtuple

from ..base.errors import UserError

Field = namedtuple("Field", "name value line")
Token = namedtuple("Token", "kind text value line")


class PrototxtError(UserError):
    """A malformed or unsupported prototxt: ``PrototxtError(path, line, message)``."""

    def __init__(self, path, line, message):
        self.path, self.line = path, line
        where = f"{path}:{line}: " if line else f"{path}: "
        super().__init__(f"{where}{message}")


class Enum(str):
    """A bare identifier value (``pool: MAX``), as opposed to a quoted string."""


class Message:
    """A parsed message of schema type ``type_name``, starting at ``line``."""

    def __init__(self, type_name, line):
        self.type_name, self.line, self.fields = type_name, line, []

    def all(self, name):
        """Every value of field ``name`` (repeated fields), in file order."""
        return [f.value for f in self.fields if f.name == name]

    def get(self, name, default=None):
        values = self.all(name)
        return values[-1] if values else default

    def has(self, name):
        return any(f.name == name for f in self.fields)

    def line_of(self, name):
        lines = [f.line for f in self.fields if f.name == name]
        return lines[-1] if lines else self.line


# ---------------------------------------------------------------- tokenizer
_PUNCT = "{}[]<>:,;"


def tokenize(text, path):
    """The tokens of ``text``: ('punct'|'name'|'number'|'string', text, value, line)."""
    tokens, i, line, n = [], 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c in _PUNCT:
            tokens.append(Token("punct", c, c, line))
            i += 1
        elif c in "\"'":
            value, i, line = _string(text, i, line, path)
            tokens.append(Token("string", value, value, line))
        elif c.isalpha() or c == "_":
            start = i
            while i < n and (text[i].isalnum() or text[i] in "_."):
                i += 1
            word = text[start:i]
            tokens.append(Token("name", word, word, line))
        elif c.isdigit() or c in "-+.":
            start = i
            i += 1
            while i < n and (text[i].isalnum() or text[i] in ".+-") and not (
                    text[i] in "+-" and text[i - 1] not in "eE"):
                i += 1
            word = text[start:i]
            tokens.append(Token("number", word, _number(word, line, path), line))
        elif "\udc80" <= c <= "\udcff":
            raise _not_utf8(c, path, line)
        else:
            raise PrototxtError(path, line, f"unexpected character {c!r}")
    return tokens


def _string(text, i, line, path):
    """A quoted string from ``text[i]``: protobuf's text-format escapes (C's:
    \\n \\t \\r \\a \\b \\f \\v \\\\ \\' \\" \\?, octal \\ooo and hex \\xhh
    bytes, the whole read as UTF-8; \\uXXXX and \\UXXXXXXXX code points);
    another escape is refused, as protobuf refuses it, not read as its letter."""
    quote, i, start_line, out = text[i], i + 1, line, bytearray()
    escapes = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "r": "\r", "a": "\a",
               "b": "\b", "f": "\f", "v": "\v", "?": "?"}
    while True:
        if i >= len(text) or text[i] == "\n":
            raise PrototxtError(path, start_line, "string is not closed on its line")
        c = text[i]
        if c == quote:
            try:
                return out.decode("utf-8"), i + 1, line
            except UnicodeDecodeError as e:
                raise PrototxtError(path, start_line, f"string's escapes make bytes that are "
                                                      f"not UTF-8 text ({e.reason} at byte "
                                                      f"{e.start})") from None
        if c == "\\" and i + 1 < len(text):
            e = text[i + 1]
            octal = re.match(r"[0-7]{1,3}", text[i + 1:i + 4])
            hexa = re.match(r"x([0-9a-fA-F]{1,2})", text[i + 1:i + 4])
            if e in escapes:
                out += escapes[e].encode()
                i += 2
            elif octal and int(octal.group(), 8) < 256:
                out.append(int(octal.group(), 8))
                i += 1 + len(octal.group())
            elif hexa:
                out.append(int(hexa.group(1), 16))
                i += 1 + len(hexa.group())
            elif e in "uU":  # a code point: \uXXXX (a surrogate pair joined), \UXXXXXXXX
                point, i = _unicode_escape(text, i, line, path)
                out += chr(point).encode("utf-8")
            elif octal:
                raise PrototxtError(path, line, f"octal escape '\\{octal.group()}' is over "
                                                "\\377, the largest byte")
            else:
                raise PrototxtError(path, line, f"unknown escape '\\{e}' in a string (protobuf "
                                                "refuses it); write '\\\\' for a backslash")
        elif "\udc80" <= c <= "\udcff":
            raise _not_utf8(c, path, line)
        else:
            out += c.encode("utf-8")
            i += 1


def _number(word, line, path):
    body = word.lstrip("+-").lower()
    sign = -1 if word.startswith("-") else 1
    if body in ("inf", "infinity", "nan"):
        return sign * float(body)
    try:
        if body.startswith("0x"):
            return sign * int(body, 16)
        if all(ch.isdigit() for ch in body):
            return sign * int(body)
        return float(word.rstrip("fF"))
    except ValueError:
        raise PrototxtError(path, line, f"malformed number {word!r}") from None


def _unicode_escape(text, i, line, path):
    """The code point of the ``\\u`` / ``\\U`` escape at ``text[i]`` (as
    protobuf's tokenizer reads it: 4 / 8 hex digits; a high surrogate
    followed by a ``\\u`` low one is one code point) and the index after it."""
    letter = text[i + 1]
    digits = 4 if letter == "u" else 8
    word = text[i + 2:i + 2 + digits]
    if not re.fullmatch(f"[0-9a-fA-F]{{{digits}}}", word):
        raise PrototxtError(path, line, f"escape '\\{letter}' needs {digits} hex digits "
                                        f"(got {word!r})")
    point, i = int(word, 16), i + 2 + digits
    low = re.match(r"\\u(d[c-f][0-9a-f]{2})", text[i:i + 6], re.IGNORECASE)
    if 0xD800 <= point <= 0xDBFF and low:
        return 0x10000 + ((point - 0xD800) << 10) + int(low.group(1), 16) - 0xDC00, i + 6
    if 0xD800 <= point <= 0xDFFF or point > 0x10FFFF:
        raise PrototxtError(path, line, f"escape '\\{letter}{word}' is not "
                                        "a Unicode character (a lone surrogate, or past "
                                        "U+10FFFF)")
    return point, i


# ------------------------------------------------------------------- parser
class _Parser:
    def __init__(self, tokens, schema, path, repeated=None):
        self.tokens, self.schema, self.path, self.pos = tokens, schema, path, 0
        self.repeated = repeated
        self.open = []  # (message type, line of its '{') of the enclosing messages
        self.building = []  # the messages being parsed, outermost first

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self):
        tok = self.peek()
        self.pos += 1
        return tok

    def last_line(self):
        return self.tokens[-1].line if self.tokens else 1

    def expect(self, text, opened=None):
        tok = self.take()
        if tok is None or tok.text != text or tok.kind == "string":
            if tok is None and opened is not None:
                raise PrototxtError(self.path, opened, f"'{_OPEN[text]}' opened here is never "
                                                       f"closed (expected '{text}' before the "
                                                       "end of the file)")
            found = "the end of the file" if tok is None else repr(tok.text)
            raise PrototxtError(self.path, tok.line if tok else self.last_line(),
                                f"expected '{text}', found {found}")
        return tok

    def message(self, type_name, line, close=None, opened=None):
        msg = Message(type_name, line)
        self.building.append(msg)
        try:
            return self._fields(msg, close, opened)
        finally:
            self.building.pop()

    def _fields(self, msg, close, opened):
        type_name = msg.type_name
        fields = self.schema[type_name]
        while True:
            tok = self.peek()
            if tok is None:
                if close is None:
                    return msg
                self.expect(close, opened)
            if close is not None and tok.kind == "punct" and tok.text == close:
                self.take()
                return msg
            if tok.kind != "name":
                raise PrototxtError(self.path, tok.line, f"expected a field name in "
                                                         f"{type_name}, found {tok.text!r}")
            self.take()
            if tok.text not in fields:
                outer = [line for kind, line in self.open[:-1] if tok.text in self.schema[kind]]
                if outer and opened is not None:  # most likely a missing '}'
                    raise PrototxtError(self.path, opened, f"'{{' opened here is not closed "
                                                           f"before '{tok.text}' on line "
                                                           f"{tok.line} (a missing '}}')")
                raise PrototxtError(self.path, tok.line, self.in_layer() +
                                    _unknown(tok.text, type_name, fields))
            kind = fields[tok.text]
            if self.repeated is not None and tok.text not in self.repeated.get(type_name, ()):
                first = next((f.line for f in msg.fields if f.name == tok.text), None)
                if first is not None:
                    raise PrototxtError(self.path, tok.line, self.in_layer() + (
                        f"field '{tok.text}' of {type_name} is given twice (also on line "
                        f"{first}); it holds one value (protobuf refuses a second): keep one"))
            values = self.value(tok, kind)
            if self.repeated is not None and len(values) > 1 and \
                    tok.text not in self.repeated.get(type_name, ()):
                raise PrototxtError(self.path, tok.line, self.in_layer() + (
                    f"field '{tok.text}' of {type_name} holds one value, not a list of "
                    f"{len(values)}"))
            for value in values:
                msg.fields.append(Field(tok.text, value, tok.line))
            nxt = self.peek()
            if nxt is not None and nxt.kind == "punct" and nxt.text in ",;":
                self.take()

    def in_layer(self):
        """"layer 'x' (type Y): " for errors inside a layer whose name and
        type were read before the error, else ""."""
        for msg in reversed(self.building):
            if msg.type_name in ("LayerParameter", "V1LayerParameter"):
                name, kind = msg.get("name"), msg.get("type")
                if name is None and kind is None:
                    return ""
                return f"layer '{name or '?'}' (type {kind or '?'}): "
        return ""

    def value(self, name_tok, kind):
        """The value(s) after a field name, checked against the field's kind."""
        tok = self.peek()
        is_message = kind in self.schema
        if tok is not None and tok.kind == "punct" and tok.text == ":":
            self.take()
            tok = self.peek()
        elif not is_message:
            self.expect(":")
        if tok is None:
            raise PrototxtError(self.path, name_tok.line,
                                f"field '{name_tok.text}' has no value before the end of the file")
        if is_message:
            if tok.kind != "punct" or tok.text not in "{<":
                raise PrototxtError(self.path, tok.line, f"field '{name_tok.text}' is a "
                                                         f"{kind} message: expected '{{', found "
                                                         f"{tok.text!r}")
            self.take()
            close = "}" if tok.text == "{" else ">"
            self.open.append((kind, tok.line))
            msg = self.message(kind, tok.line, close, tok.line)
            self.open.pop()
            return [msg]
        if tok.kind == "punct" and tok.text == "[":
            self.take()
            values = []
            while True:
                values.append(self.scalar(name_tok, kind))
                sep = self.take()
                if sep is not None and sep.text == "]" and sep.kind == "punct":
                    return values
                if sep is None or sep.text != ",":
                    raise PrototxtError(self.path, sep.line if sep else self.last_line(),
                                        f"expected ',' or ']' in the list of "
                                        f"'{name_tok.text}'")
        return [self.scalar(name_tok, kind)]

    def scalar(self, name_tok, kind):
        tok = self.take()
        if tok is None:
            raise PrototxtError(self.path, self.last_line(), f"field '{name_tok.text}' has no "
                                                             "value before the end of the file")
        want = {"string": "a quoted string", "int": "an integer", "float": "a number",
                "bool": "true or false"}.get(kind, f"one of {', '.join(kind or ())}")
        if kind == "string" and tok.kind == "string":
            return tok.value
        if kind == "int" and tok.kind == "number" and isinstance(tok.value, int):
            return tok.value
        if kind == "float" and tok.kind == "number":
            return float(tok.value)
        if kind == "float" and tok.kind == "name" and tok.text.lower() in ("inf", "nan"):
            return float(tok.text)
        if kind == "bool" and tok.kind in ("name", "number") and tok.text in (
                "true", "false", "True", "False", "t", "f", "1", "0"):
            return tok.text in ("true", "True", "t", "1")
        if isinstance(kind, tuple) and tok.kind == "name" and tok.text in kind:
            return Enum(tok.text)
        if isinstance(kind, tuple) and tok.kind == "number" and isinstance(tok.value, int) \
                and 0 <= tok.value < len(kind):
            return Enum(kind[tok.value])  # enums may be written by number
        raise PrototxtError(self.path, tok.line, f"{self.in_layer()}field '{name_tok.text}': "
                                                 f"expected {want}, found {tok.text!r}")


_OPEN = {"}": "{", ">": "<", "]": "["}


def _unknown(name, type_name, fields):
    import difflib
    close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.7)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"unknown or unsupported field '{name}' in {type_name}{hint}; supported: "
            f"{', '.join(sorted(fields))}")


def parse(text, schema, root, path="<prototxt>", repeated=None):
    """The ``root`` message parsed from ``text`` against ``schema``;
    ``repeated`` ({message type: field names}): the repeated fields, when
    given; any other field given twice in one message is then refused, as
    protobuf refuses it (a second ``base_lr`` would otherwise replace the
    first without a word)."""
    parser = _Parser(tokenize(text, path), schema, path, repeated)
    parser.open.append((root, 1))
    return parser.message(root, 1)


def parse_file(path, schema, root, repeated=None):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise PrototxtError(path, None, "file not found") from None
    except IsADirectoryError:
        raise PrototxtError(path, None, "is a folder; expected a text prototxt file") from None
    except OSError as e:
        raise PrototxtError(path, None, f"cannot read the file ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if re.search(rb"[\x00-\x08\x0e-\x1f]", data):  # a .caffemodel, HDF5: binary, not text
            raise PrototxtError(path, None, f"is not a text prototxt (binary data at byte "
                                            f"{e.start}); a binary .caffemodel holds weights, "
                                            "which train --init / test --weights read, not a "
                                            "definition") from None
        # text in another encoding (a Latin-1 comment): protobuf reads bytes, so
        # a comment's are skipped as Caffe skips them; one elsewhere is refused
        # at its line (_not_utf8)
        text = data.decode("utf-8", "surrogateescape")
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # as open()'s universal newlines
    return parse(text, schema, root, path, repeated)


def _not_utf8(c, path, line):
    """A PrototxtError for the byte a ``surrogateescape`` decoding made ``c``."""
    return PrototxtError(path, line, f"byte 0x{ord(c) - 0xDC00:02x} is not UTF-8 text (a "
                                     "Latin-1 or other file encoding?): save the file as "
                                     "UTF-8")
