"""Subword vocabularies for token data (docs/formats.md, "HDF5 text files";
docs/transformers.md, "Tokenizers"), through Hugging Face's ``tokenizers``
library, an optional extra (``pip install 'purine_mpi[text]'``), imported
only when a vocabulary is asked for:

    from_file(path)            a tokenizer.json the user has (e.g. GPT-2's), with
                               its truncation and padding turned off
    train_bpe(texts, n)        a byte-level BPE of n tokens trained on texts
    Vocabulary(json_text)      encode, decode, and decode a stream of ids

A vocabulary travels as the tokenizer's own JSON (``Tokenizer.to_str()``):
the data file holds it as the dataset ``/tokenizer`` and a checkpoint as
well, so a checkpoint alone decodes (``generate``). Files without it are
byte-level: the 256 byte values (data/text.py).

``train_bpe`` is the GPT-2 recipe: the ByteLevel pre-tokenizer (GPT-2's
split regex, each byte mapped to one of 256 printable characters), a BPE
model whose initial alphabet is all 256 of them, and the ByteLevel decoder,
so every byte sequence is encoded and every UTF-8 text decodes to itself.
Training runs offline on the given texts; it is deterministic (the same
texts and n give the same JSON).
"""
import functools
import hashlib

import numpy as np

from ..base.errors import UserError

#: where the optional library comes from (named by the exit-2 line)
INSTALL = "pip install 'purine_mpi[text]' (or pip install tokenizers)"
#: the name of the dataset holding a vocabulary's JSON (data file, checkpoint)
DATASET = "tokenizer"
#: the smallest byte-level BPE: its alphabet, the 256 byte values
MIN_BPE = 256
#: the largest BPE ``data text --bpe-vocab`` trains: 2**24 tokens (GPT-2 has
#: 50,257; the largest LLM vocabularies about 2**18). The trainer allocates
#: for the size asked before it starts (about 45 bytes a token): 10**11
#: aborted the process (a Rust allocation failure, exit 134)
MAX_BPE = 1 << 24


def tokenizers_module(what):
    """The ``tokenizers`` package, or a UserError naming the extra that
    brings it (``what``: the option that needs it)."""
    try:
        import tokenizers
    except ImportError:
        raise UserError(f"{what} needs the Hugging Face tokenizers library: "
                        f"{INSTALL}") from None
    return tokenizers


def from_file(path):
    """The tokenizer.json at ``path`` as a ``tokenizers.Tokenizer``
    (UserError naming the file when it is missing or not a tokenizer)."""
    import os
    tk = tokenizers_module("data text --tokenizer")
    if not os.path.isfile(path):
        raise UserError(f"data text: --tokenizer {path} not found (expected a tokenizer.json "
                        "saved by Hugging Face tokenizers)")
    try:
        tokenizer = tk.Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own parse errors (a Rust Exception)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"data text: --tokenizer {path} is not a Hugging Face tokenizer.json "
                        f"({first})") from None
    return tokenizer, whole_text(tokenizer)


def whole_text(tokenizer):
    """Turn off the truncation and padding a tokenizer.json may carry
    (``Tokenizer.enable_truncation`` / ``enable_padding``, saved with it by
    a model's tokenizer for its fixed-length inputs): a token stream is the
    whole text, each id a token of it. Kept, truncation cut every file (and
    a prompt) to ``max_length`` tokens, the rest counted as characters "no
    token covers", and padding put pad ids into the stream (a 9-character
    prompt became 20,000 tokens). Returns the words naming what was turned
    off (empty: nothing was on)."""
    off = []
    cut = tokenizer.truncation
    if cut is not None:
        off.append(f"truncation to {cut.get('max_length')} tokens")
        tokenizer.no_truncation()
    pad = tokenizer.padding
    if pad is not None:
        length = pad.get("length")
        off.append(f"padding with {pad.get('pad_token')!r} (id {pad.get('pad_id')}) to "
                   + (f"{length} tokens" if length else "the longest input"))
        tokenizer.no_padding()
    return off


def train_bpe(texts, vocab_size):
    """A byte-level BPE of ``vocab_size`` tokens (at most: a text with fewer
    distinct merges gives fewer) trained on the strings ``texts``."""
    if vocab_size < MIN_BPE:
        raise UserError(f"data text: --bpe-vocab must be at least {MIN_BPE} (the byte "
                        f"alphabet), got {vocab_size}")
    if vocab_size > MAX_BPE:
        raise UserError(f"data text: --bpe-vocab must be at most {MAX_BPE:,} tokens, got "
                        f"{vocab_size:,}")
    # each merge joins a pair that occurs in the text: no more than one per
    # byte of it (the same vocabulary, without allocating for the rest)
    texts = list(texts)
    vocab_size = min(int(vocab_size), MIN_BPE + sum(len(t.encode("utf-8")) for t in texts))
    tk = tokenizers_module("data text --bpe-vocab")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tokenizer = tk.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer)
    return tokenizer


def dropped_characters(text, offsets):
    """The indices of the characters of ``text`` no token of an encoding
    covers (``offsets``: its tokens' (start, end) character spans): what the
    tokenizer drops (not in a vocabulary without byte fallback or an
    unknown token). Whitespace is left out: a pre-tokenizer splitting on it
    drops it by its own rule. Only the gaps between the spans are looked
    at (memory of the order of the tokens, not of the text)."""
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    reach = np.maximum.accumulate(spans[:, 1]) if len(spans) else spans[:, 1]
    # a gap runs from the furthest end so far to the next span's start
    gap_starts = np.concatenate([[0], reach])
    gap_ends = np.concatenate([spans[:, 0], [len(text)]])
    found = []
    for a, b in zip(*(x[gap_ends > gap_starts].tolist() for x in (gap_starts, gap_ends))):
        if not text[a:b].isspace():
            found.extend(i for i in range(a, b) if not text[i].isspace())
    return found


def unknown_id(tokenizer):
    """The id of the model's unknown token (BPE, WordPiece, WordLevel: its
    ``unk_token``; Unigram: its ``unk_id``), or None without one."""
    import json
    model = json.loads(tokenizer.to_str()).get("model") or {}
    if isinstance(model.get("unk_token"), str):
        return tokenizer.token_to_id(model["unk_token"])
    return model.get("unk_id") if isinstance(model.get("unk_id"), int) else None


def unknown_characters(text, ids, offsets, unk):
    """The indices of the characters of ``text`` (whitespace left out) that
    the tokens of id ``unk`` (the unknown token) stand for: text the
    vocabulary has no token for, replaced by one that decodes to none of it."""
    if unk is None:
        return []
    return [i for token, (a, b) in zip(ids, offsets) if token == unk
            for i in range(a, b) if not text[i].isspace()]


def vocab_size_of(tokenizer):
    """Rows an embedding needs for ``tokenizer``: its largest id + 1 (added
    tokens included)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def digest(json_text):
    """SHA-256 (hex) of a vocabulary's JSON text as stored (the ``sha256``
    attribute: the text's integrity); whether two files' vocabularies agree
    is ``vocabulary_digest``'s."""
    return hashlib.sha256(json_text.encode("utf-8")).hexdigest()


def whole_text_json(json_text):
    """A vocabulary's JSON with its ``truncation`` and ``padding`` off (null),
    as ``whole_text`` leaves a tokenizer and ``data text`` stores it now:
    the JSON a file written before that fix holds, made what every reader
    encodes with, so a checkpoint and an ``export hf`` folder's
    tokenizer.json carry neither (Hugging Face applies them). Unchanged
    when both are off already, or the JSON does not parse (plain JSON,
    without the tokenizers library)."""
    import json
    spec, changed = _whole_text_spec(json_text)
    return json.dumps(spec, ensure_ascii=False) if changed else json_text


def _whole_text_spec(json_text, parse_float=None):
    """(the JSON object of a vocabulary's text with its ``truncation`` and
    ``padding`` off (null), whether either was on), or (None, False) where
    the text does not parse to a JSON object."""
    import json
    try:
        spec = json.loads(json_text, parse_float=parse_float)
    except ValueError:
        return None, False
    if not isinstance(spec, dict):
        return None, False
    changed = spec.get("truncation") is not None or spec.get("padding") is not None
    return dict(spec, truncation=None, padding=None), changed


def _rounded(text):
    """A JSON number as 12 significant digits: a score the tokenizers
    library writes with 17 (0.19: -7.4070626413948215) reads back one ulp
    off in a newer one (0.23 writes -7.407062641394821), the same score."""
    return float(f"{float(text):.12g}")


def _one_spelling(spec):
    """``spec`` (a vocabulary's JSON object) as one spelling of what the
    tokenizers library's versions write for the same tokenizer (checked
    against 0.13.3's and 0.19.1's ``to_str`` read back by 0.23): BPE merges
    as [a, b] pairs (before 0.20 "a b" strings, which cannot hold a space
    in a token, so the first space splits them), no ``ignore_merges`` or
    ``byte_fallback`` false (absent before 0.19 and 0.14: false), and a
    Metaspace's ``add_prefix_space`` (before 0.14) as its
    ``prepend_scheme`` ("always" or "never") and ``split`` (true)."""
    def metaspace(node):  # the small components, not the model's vocabulary
        if isinstance(node, list):
            return [metaspace(n) for n in node]
        if not isinstance(node, dict):
            return node
        node = {k: metaspace(v) for k, v in node.items()}
        if node.get("type") == "Metaspace" and "add_prefix_space" in node \
                and "prepend_scheme" not in node:
            node["prepend_scheme"] = "always" if node.pop("add_prefix_space") else "never"
            node.setdefault("split", True)
        return node
    spec = {k: v if k == "model" else metaspace(v) for k, v in spec.items()}
    model = spec.get("model")
    if not isinstance(model, dict):
        return spec
    model = dict(model)
    if isinstance(model.get("merges"), list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m
                           for m in model["merges"]]
    for key in ("ignore_merges", "byte_fallback"):
        if model.get(key) is False:
            del model[key]
    return dict(spec, model=model)


@functools.lru_cache(maxsize=4)  # a start-up digests the data's text per file and per check
def vocabulary_digest(json_text):
    """SHA-256 (hex) of what a vocabulary's JSON encodes with: the JSON with
    its ``truncation`` and ``padding`` off (null, as ``whole_text`` leaves
    them, which every reader does: ``Vocabulary``), written as the
    tokenizers library's versions agree (``_one_spelling``, its numbers to
    12 digits: ``_rounded``) and its keys in a canonical order, so a file
    written before ``data text`` turned them off, or by another version of
    the library, agrees with a new one of the same tokenizer, while any
    other difference (the model, its merges, the normaliser, the added
    tokens) still tells two vocabularies apart. A JSON that does not parse
    is digested as it is (it matches only itself)."""
    import json
    spec, _ = _whole_text_spec(json_text, parse_float=_rounded)
    if spec is None:
        return digest(json_text)
    return digest(json.dumps(_one_spelling(spec), sort_keys=True, separators=(",", ":"),
                             ensure_ascii=False))


def write_json(h5obj, json_text):
    """Store ``json_text`` as the UTF-8 string dataset ``DATASET`` of an open
    h5py group, with its ``sha256`` and ``vocab_size`` as attributes."""
    import h5py
    import json
    d = h5obj.create_dataset(DATASET, data=json_text, dtype=h5py.string_dtype("utf-8"))
    d.attrs["sha256"] = digest(json_text)
    d.attrs["vocab_size"] = _json_vocab_size(json.loads(json_text))
    return d


def _json_vocab_size(spec):
    """Largest id + 1 of a tokenizer's JSON (model vocab and added tokens),
    read without the library."""
    ids = [t.get("id", -1) for t in spec.get("added_tokens") or ()]
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids.extend(vocab.values())
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids.append(len(vocab) - 1)
    return max(ids) + 1 if ids else 0


def check_json(json_text, where, library=False):
    """A UserError naming ``where`` (the file and its ``/tokenizer``) unless
    ``json_text`` is a tokenizer's JSON: an object with a ``model``, and,
    with ``library`` (a reader that encodes with it: ``Vocabulary``) and the
    tokenizers library installed, one it reads (training needs the ids
    alone, and a checkpoint copies the JSON: a file of a newer library's
    format still trains); with ``library``, returns the library's
    ``Tokenizer`` of it. Checked when a file is opened, so a damaged
    vocabulary stops a run before its first iteration (not at its first
    checkpoint) and ``generate`` with one line."""
    import json
    try:
        spec = json.loads(json_text)
    except ValueError as e:
        raise UserError(f"{where} is not a tokenizer's JSON ({type(e).__name__}: "
                        f"{str(e).splitlines()[0]}); expected the JSON text a Hugging Face "
                        "tokenizer.json holds (data text --tokenizer / --bpe-vocab writes "
                        "it)") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise UserError(f"{where} is not a tokenizer's JSON: expected an object with a "
                        f"'model' object (a Hugging Face tokenizer.json), got "
                        f"{type(spec).__name__}" + (f" with keys {sorted(spec)[:6]}"
                                                     if isinstance(spec, dict) else ""))
    if not library:
        return
    try:
        import tokenizers
    except ImportError:  # Vocabulary names the extra itself
        return
    try:
        return tokenizers.Tokenizer.from_str(json_text)  # the reader's tokenizer: one parse
    except Exception as e:  # the library's own parse errors (a Rust Exception)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{where} is not a tokenizer the tokenizers library reads "
                        f"({first})") from None


def check_stored(json_text, sha256, what, remedy=""):
    """A UserError unless the vocabulary JSON ``json_text`` stored in the
    file ``what`` names (e.g. "text data file 'x.h5'") is the text its
    ``sha256`` attribute digests (None: a file without one, not checked)
    and a tokenizer's JSON (``check_json``); ``remedy`` ends the first."""
    if sha256 is not None and digest(json_text) != sha256:
        raise UserError(f"{what} is corrupt: '/{DATASET}' does not match its sha256 "
                        f"attribute; it was damaged or edited{remedy}")
    check_json(json_text, f"{what}: its '/{DATASET}'")


def read_json(h5obj):
    """The vocabulary JSON an open h5py file or group holds (``DATASET``),
    or None when it holds none (byte-level)."""
    if DATASET not in h5obj:
        return None
    value = h5obj[DATASET][()]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def read_stored(h5obj):
    """(the vocabulary JSON an open h5py file or group holds, ``read_json``'s;
    the ``sha256`` attribute it was written with, as text): what
    ``check_stored`` compares; (None, None) for none (byte-level), and None
    for a file without the attribute."""
    text = read_json(h5obj)
    if text is None:
        return None, None
    want = h5obj[DATASET].attrs.get("sha256")
    return text, (want.decode("utf-8", "replace") if isinstance(want, bytes) else want)


class Vocabulary:
    """A vocabulary's JSON as a tokenizer: ``encode`` a prompt, ``decode``
    ids, and ``stream`` (the text of each id as it comes)."""

    def __init__(self, json_text, what="the checkpoint's vocabulary",
                 where="the checkpoint's /tokenizer"):
        tokenizers_module(what)  # the extra named where it is missing
        self.json = json_text
        self.tokenizer = check_json(json_text, where, library=True)
        whole_text(self.tokenizer)  # a file written before data text turned them off
        self.size = vocab_size_of(self.tokenizer)

    def encode(self, text, what="--prompt"):
        """The ids of ``text``; a character the tokenizer drops (no token
        covers it: not in a vocabulary without byte fallback or an unknown
        token) is a UserError naming it, rather than a context silently
        shorter than ``text``; dropped whitespace (a pre-tokenizer's split) is
        the tokenizer's own rule."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        for i in dropped_characters(text, encoding.offsets)[:1]:
            raise UserError(f"{what} character {text[i]!r} (U+{ord(text[i]):04X}, character "
                            f"{i + 1}) is not in the model's vocabulary: its tokenizer drops "
                            "it; leave it out or spell it with the vocabulary's characters")
        unk = unknown_id(self.tokenizer)
        # the unknown token stands for text it does not hold (the model reads
        # '[UNK]', not the character): refused as a dropped one is; the
        # unknown token's own text typed in the prompt is that token
        name = self.tokenizer.id_to_token(unk) if unk is not None else None
        for token, (a, b) in zip(encoding.ids, encoding.offsets):
            if token == unk and text[a:b] != name and not text[a:b].isspace():
                raise UserError(f"{what} text {text[a:b]!r} (characters {a + 1} to {b}) is not "
                                "in the model's vocabulary: its tokenizer encodes it as its "
                                f"unknown token {name!r}, which the model reads in its place; "
                                "leave it out or spell it with the vocabulary's tokens")
        return list(encoding.ids)

    def decode(self, ids):
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def stream(self):
        """An incremental decoder: ``step(id)`` returns the text that id
        completes ('' while a character's bytes are still incomplete: a
        decoded tail ending in U+FFFD waits for the next id); ``flush()`` the
        rest, an incomplete character as U+FFFD."""
        return _Stream(self)


class _Stream:
    """Text generation's incremental detokenization: the text of the ids
    since ``prefix`` minus that of the ids up to ``read`` (a few ids of
    context, so a decoder that joins tokens, e.g. with spaces, is kept)."""

    def __init__(self, vocab):
        self.vocab, self.ids, self.prefix, self.read = vocab, [], 0, 0

    def step(self, token):
        self.ids.append(int(token))
        before = self.vocab.decode(self.ids[self.prefix:self.read])
        text = self.vocab.decode(self.ids[self.prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self):
        before = self.vocab.decode(self.ids[self.prefix:self.read])
        text = self.vocab.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]
