"""Token data: UTF-8 text as a token stream (docs/formats.md, "HDF5 text
files"), and the ``text`` data source that reads windows of it.

    write_text(src, out_path, glob, val_fraction, tokenizer, bpe_vocab)
                                                     a file, or a folder's files

By default the vocabulary is the 256 byte values (no tokenizer to download):
token i of a stream is byte i of the text. With ``tokenizer`` (a Hugging
Face tokenizer.json the user has) or ``bpe_vocab`` N (a byte-level BPE of N
tokens trained here on the text itself) each file is encoded with that
vocabulary (data/tokenizer.py; the ``tokenizers`` extra) and its JSON is
stored as the dataset ``/tokenizer``, so the file (and every checkpoint
trained on it) decodes its tokens. A folder's files matching ``glob`` (a
pattern without '/' matches the file name at any depth; one with '/' the
path relative to the folder, as ``pathlib`` matches it: ``*`` within one
name, ``**`` zero or more folders: ``glob_match``; default every file) are read in sorted
order of that path and concatenated, so the same folder always gives the
same file. A file name that is not UTF-8 is refused (the file records the
names). The last ``val_fraction`` of the stream
is the validation split, the rest the train split (nanoGPT's rule). The
file holds

    /train/tokens, /val/tokens   uint8 (n,) (bytes), uint16 or uint32 (a
                                 vocabulary's ids): the two streams
    /files                       the source files, in order (relative paths)
    /file_bytes                  int64: their sizes
    /file_tokens                 int64: their token counts (with a vocabulary)
    /tokenizer                   the vocabulary's JSON (with a vocabulary)
    attrs: format "purine_mpi.text", vocab_size (256, or the vocabulary's),
           encoding, tokenizer ("bytes", "file" or "bpe"), source, glob,
           bytes, tokens, val_fraction, version (of purine_mpi), sha256 (of
           the whole stream's bytes as stored), dropped_characters (those
           the vocabulary has no token for), unknown_characters (those
           encoded as its unknown token): a note counts them; more than
           DROP_LIMIT of the text is refused

``TextSource`` turns a split of it into samples for the DataReader: sample i
is the window of ``sequence_length + 1`` tokens starting at ``i * stride``;
its data are the first ``sequence_length`` tokens and its label the last
``sequence_length`` (the next token at every position), both int32. The
stride is 1 for a shuffled spec (every offset is a sample: a shuffled epoch
visits every window once, in the seeded order of data/sources.py) and
``sequence_length`` otherwise (a test pass reads disjoint windows in order,
so each token of the split is predicted at most once: all but the first
and the last (n - 1) % sequence_length). Which windows a rank reads is
the rule of data/sources.py (``batch_indices``), so N ranks x B read the
windows of 1 rank x N*B.
"""
import fnmatch
import functools
import hashlib
import os

import numpy as np

from ..base.errors import DataSpecError, UserError, one_line
from ..base.runfiles import HDF5_MODE, make_parent, stop_if_write_failed, write_hdf5_replacing
from .filecache import INFO_DIGEST_BYTES, per_file_version
from .h5links import link_outside

FORMAT = "purine_mpi.text"
VOCAB_SIZE = 256


# ------------------------------------------------------------------ writing
def glob_match(rel, pattern):
    """Whether the relative path ``rel`` ('/'-separated) matches ``pattern``:
    a pattern without '/' matches the file name; one with '/' matches the
    whole path as ``pathlib``'s ``PurePath.full_match`` (Python 3.13) does:
    ``*`` and ``?`` within one name, ``**`` alone between slashes zero or
    more folders (``**/*.txt`` matches ``a.txt`` and ``x/y/a.txt``; a last
    ``**`` every file below)."""
    if "/" not in pattern:
        return fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], pattern)
    return _match_parts(tuple(rel.split("/")), tuple(p for p in pattern.split("/") if p))


def _match_parts(parts, pats):
    if not pats:
        return not parts
    if pats[0] == "**":  # zero or more names (a last '**': every file below)
        return any(_match_parts(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and \
        _match_parts(parts[1:], pats[1:])


def _utf8_name(name, path):
    """``name``, a UserError naming ``path`` when it is not UTF-8 (Python
    holds such a name's bytes as surrogate escapes): the file records the
    names as UTF-8 text."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise UserError(f"data text: the name of '{shown}' is not UTF-8: rename it, or leave it "
                        "out with --glob") from None
    return name


def text_files(src, glob=None):
    """[(relative name, path)] of the text ``src``: the file itself, or the
    files under the folder ``src`` whose relative path matches ``glob``
    (``glob_match``), in sorted order. Raises UserError when there is
    nothing to read or a name is not UTF-8."""
    _utf8_name(os.path.abspath(src), src)
    if os.path.isfile(src):
        if glob is not None:
            raise UserError(f"data text: --glob {glob} applies to a folder, but --from {src} "
                            "is a file")
        return [(os.path.basename(src), src)]
    if not os.path.isdir(src):  # a pipe, a device (/dev/null): there, but no file to read
        what = "is not a regular file" if os.path.exists(src) else "not found"
        raise UserError(f"data text: --from {src} {what} (expected a UTF-8 text file or a "
                        "folder of them)")
    pattern = glob or "*"
    found = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            if glob_match(rel, pattern) and os.path.isfile(path):
                found.append((_utf8_name(rel, path), path))
    if not found:
        raise UserError(f"data text: no file under --from {src} matches --glob {pattern}")
    return sorted(found)


def read_text(files):
    """The bytes of ``files`` concatenated; each must be UTF-8 (a UserError
    names the first that is not, with the byte offset)."""
    parts = []
    for rel, path in files:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"data text: {path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                            "give --glob to pick the text files") from None
        parts.append(raw)
    return parts


def write_text(src, out_path, glob=None, val_fraction=0.1, log=None, tokenizer=None,
               bpe_vocab=None):
    """Write the token file of ``src`` (see the module docstring) atomically:
    byte-level, or encoded with the tokenizer.json ``tokenizer`` or with a
    byte-level BPE of ``bpe_vocab`` tokens trained on the text; returns a
    summary dict."""
    import h5py
    from .. import __version__
    if not 0.0 < float(val_fraction) < 1.0:
        raise UserError(f"data text: --val-fraction must lie in (0, 1), got {val_fraction}")
    if tokenizer is not None and bpe_vocab is not None:
        raise UserError("data text: give --tokenizer FILE or --bpe-vocab N, not both")
    files = text_files(src, glob)
    if os.path.exists(out_path):
        for _, path in files:
            if os.path.samefile(path, out_path):
                raise UserError(f"--out {out_path} is one of the --from files read: writing the "
                                "output there would replace it; give another --out")
    vocab = None
    if tokenizer is not None:  # before the text is read: a bad file fails at once
        from .tokenizer import from_file
        vocab, off = from_file(tokenizer)
        if off and log:  # the stream is the whole text, as the stored JSON now says
            log(f"note: --tokenizer {tokenizer} asks for {' and '.join(off)}; not applied: "
                "each file is encoded whole, without pad tokens (the file keeps the "
                "tokenizer without them)")
    parts = read_text(files)
    n_bytes = sum(len(p) for p in parts)
    if bpe_vocab is not None:
        from .tokenizer import train_bpe
        vocab = train_bpe([p.decode("utf-8") for p in parts], int(bpe_vocab))
        if log:
            log(f"trained a byte-level BPE of {_vocab_size(vocab):,} tokens"
                + ("" if _vocab_size(vocab) == int(bpe_vocab) else
                   f" (--bpe-vocab {bpe_vocab}: the text has no more pairs to merge)"))
    n_dropped = n_unknown = 0
    if vocab is None:
        stream, vocab_size, json_text, per_file = \
            np.frombuffer(b"".join(parts), dtype=np.uint8), VOCAB_SIZE, None, None
    else:
        stream, per_file, dropped, unknown = _encode(vocab, parts)
        n_dropped, n_unknown = sum(len(d) for d in dropped), sum(len(u) for u in unknown)
        note = _dropped_note(files, [p.decode("utf-8") for p in parts], dropped, unknown,
                             vocab)
        if note and log:
            log(note)
        vocab_size, json_text = _vocab_size(vocab), vocab.to_str()
    n_val = int(round(len(stream) * float(val_fraction)))
    if n_val < 2 or len(stream) - n_val < 2:
        raise UserError(f"data text: {src} holds {len(stream)} tokens: too few for a train and "
                        f"a validation split with --val-fraction {val_fraction}")
    splits = {"train": stream[:len(stream) - n_val], "val": stream[len(stream) - n_val:]}
    make_parent(out_path)
    kind = "bytes" if vocab is None else ("file" if tokenizer is not None else "bpe")
    encoding = {"bytes": "bytes of UTF-8 text, one token per byte",
                "file": f"ids of the tokenizer.json {os.path.abspath(str(tokenizer))} "
                        "(Hugging Face tokenizers; its JSON: /tokenizer)",
                "bpe": f"ids of a byte-level BPE of {vocab_size} tokens trained on this text "
                       "(Hugging Face tokenizers; its JSON: /tokenizer)"}[kind]

    def fill(f):
        attrs = {"format": FORMAT, "vocab_size": vocab_size, "encoding": encoding,
                 "tokenizer": kind, "source": os.path.abspath(src), "glob": glob or "",
                 "bytes": n_bytes, "tokens": len(stream), "dropped_characters": n_dropped,
                 "unknown_characters": n_unknown,
                 "val_fraction": float(val_fraction), "version": __version__,
                 "sha256": hashlib.sha256(stream.tobytes()).hexdigest()}
        for key, value in attrs.items():
            f.attrs[key] = value
        for split, tokens in splits.items():
            dset = f.create_group(split).create_dataset(
                "tokens", shape=tokens.shape, dtype=tokens.dtype,
                chunks=(min(len(tokens), 1 << 16),), compression="gzip", compression_opts=4)
            step = 64 << 16  # 64 chunks a write: a full disk stops the rest (not held in memory)
            for i in range(0, len(tokens), step):
                dset[i:i + step] = tokens[i:i + step]
                stop_if_write_failed()
        f.create_dataset("files", data=[rel.encode("utf-8") for rel, _ in files],
                         dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("file_bytes", data=np.array([len(p) for p in parts], np.int64))
        if json_text is not None:
            from .tokenizer import write_json
            f.create_dataset("file_tokens", data=np.array(per_file, np.int64))
            write_json(f, json_text)
    write_hdf5_replacing(out_path, fill, HDF5_MODE)
    summary = {"path": out_path, "files": len(files), "bytes": int(n_bytes),
               "tokens": int(len(stream)), "train": int(len(splits["train"])),
               "val": int(len(splits["val"])), "vocab_size": int(vocab_size),
               "tokenizer": kind}
    if log:
        log(f"read {len(files)} file(s), {n_bytes:,} bytes: {summary['train']:,} train and "
            f"{summary['val']:,} validation tokens"
            + ("" if vocab is None else f" of a vocabulary of {vocab_size:,}"))
    return summary


def _vocab_size(tokenizer):
    from .tokenizer import vocab_size_of
    return vocab_size_of(tokenizer)


def _encode(tokenizer, parts):
    """(the concatenated ids of each part, each part's id count, the indices
    of each part's characters the tokenizer drops, and of those it encodes
    as its unknown token): each file
    is encoded on its own, without special tokens, in the smallest unsigned
    dtype that holds the vocabulary."""
    texts = [p.decode("utf-8") for p in parts]
    from .tokenizer import dropped_characters, unknown_characters, unknown_id
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    size = _vocab_size(tokenizer)
    dtype = np.uint8 if size <= 1 << 8 else np.uint16 if size <= 1 << 16 else np.uint32
    ids = [np.asarray(e.ids, dtype=np.int64) for e in encoded]
    stream = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    dropped = [dropped_characters(t, e.offsets) for t, e in zip(texts, encoded)]
    unk = unknown_id(tokenizer)
    unknown = [unknown_characters(t, e.ids, e.offsets, unk) for t, e in zip(texts, encoded)]
    return stream.astype(dtype), [len(i) for i in ids], dropped, unknown


#: the largest share of a text's characters the tokenizer may lose (drop,
#: or encode as its unknown token; then a note counts them); above it
#: ``data text`` refuses: the wrong tokenizer
DROP_LIMIT = 0.01


def _lost_clause(files, texts, lost):
    """(count, distinct, the commonest five characters of ``lost`` (each
    file's indices), each with where it first occurs)."""
    seen = {}
    for (rel, _), text, indices in zip(files, texts, lost):
        for i in indices:
            n, where = seen.get(text[i], (0, f"{rel}, character {i + 1}"))
            seen[text[i]] = (n + 1, where)
    common = sorted(seen.items(), key=lambda kv: -kv[1][0])
    shown = "; ".join(f"{ch!r} (U+{ord(ch):04X}) x{n}, first in {where}"
                      for ch, (n, where) in common[:5]) + ("; ..." if len(common) > 5 else "")
    return sum(len(d) for d in lost), len(seen), shown


def _dropped_note(files, texts, dropped, unknown, tokenizer):
    """A note counting the characters a tokenizer lost: dropped
    (``dropped``: each file's indices; no token covers them) or encoded as
    its unknown token (``unknown``), the commonest first with where each
    first occurs; a UserError when they are more than DROP_LIMIT of the
    characters. None when nothing was lost."""
    from .tokenizer import unknown_id
    chars = sum(len(t) for t in texts)
    parts, total = [], 0
    for lost, how in ((dropped, "drops {count:,} of the {chars:,} characters of the text "
                                "({distinct} distinct; no token covers them)"),
                      (unknown, "encodes {count:,} of the {chars:,} characters of the text as "
                                "its unknown token {unk!r} ({distinct} distinct)")):
        count, distinct, shown = _lost_clause(files, texts, lost)
        if count:
            unk = tokenizer.id_to_token(unknown_id(tokenizer)) if lost is unknown else None
            parts.append(how.format(count=count, chars=chars, distinct=distinct, unk=unk)
                         + f": {shown}")
            total += count
    if not total:
        return None
    what = "the tokenizer " + "; and ".join(parts)
    if total > DROP_LIMIT * chars:
        raise UserError(f"data text: {what}; more than {DROP_LIMIT:.0%} of the text would be "
                        "lost: give a tokenizer whose vocabulary covers the text (a byte-level "
                        "one covers every character, e.g. --bpe-vocab N)")
    return f"note: {what}; the token stream does not hold them"


def text_vocabulary(path, checked=False):
    """(vocab_size, the vocabulary's JSON or None for bytes) of the text
    data file ``path``; (None, None) when it cannot be read (the source's
    own checks name the problem). ``checked``: a damaged vocabulary (its
    ``/tokenizer`` not the text its sha256 attribute digests, or not a
    tokenizer's JSON: data/tokenizer.py's ``check_stored``) is a UserError
    naming the file, found at start-up since every checkpoint copies it."""
    import h5py
    from .tokenizer import check_stored, read_stored
    try:
        with h5py.File(path, "r") as f:
            size = f.attrs.get("vocab_size")
            text, want = read_stored(f)
    except (OSError, KeyError, ValueError):
        return None, None
    size = None if size is None else int(size)
    if checked and size is not None and text is not None:
        check_stored(text, want, f"text data file '{path}'",
                     ": make the file again with data text")
    return size, text


def shared_vocabulary(paths):
    """The vocabulary JSON (None: bytes) of the text data files ``paths``
    ([(key, path)], e.g. ('data.train', 'x.h5')), which must all have the
    same one (compared with their truncation and padding off, as they
    encode: data/tokenizer.py's ``vocabulary_digest``): a UserError names
    the two that differ. Unreadable files are skipped (the source names them)."""
    from .tokenizer import vocabulary_digest, whole_text_json
    seen = None
    for key, path in paths:
        # damaged, it would stop the run at its first checkpoint: checked
        size, text = text_vocabulary(path, checked=True)
        if size is None:
            continue
        # truncation and padding off in both: a file written before data text
        # turned them off agrees with a new one of the same tokenizer
        mine = (key, path, None if text is None else vocabulary_digest(text), text)
        if seen is not None and seen[2] != mine[2]:
            def say(k, p, d):
                return f"{k} '{p}' is " + ("byte-level" if d is None else f"vocabulary {d[:12]}")
            raise UserError(f"text data files disagree on the vocabulary: "
                            f"{say(*seen[:3])}, {say(*mine[:3])}; make both with the same "
                            "--tokenizer (or the same file: train and val splits)")
        seen = seen or mine
    # as every reader encodes (a file written before data text turned them off)
    return None if seen is None or seen[3] is None else whole_text_json(seen[3])


# ------------------------------------------------------------------ reading
def window_stride(spec):
    """Tokens between the starts of consecutive samples: 1 when shuffled
    (every offset), sequence_length otherwise (disjoint windows)."""
    return 1 if spec.get("shuffle") else int(spec["sequence_length"])


def _open_tokens(path, split):
    """The split's token dataset of the text file ``path`` (an open h5py
    object, and the file); UserError naming the file and dataset."""
    import h5py
    if os.path.isdir(path):
        raise UserError(f"text data file '{path}' is a folder, not a file; give the file's "
                        "path")
    if not os.path.isfile(path):
        raise UserError(f"text data file '{path}' not found; make it with 'python -m "
                        "purine_mpi data text --from PATH --out FILE.h5'")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"text data file '{path}' cannot be opened as HDF5 ({e})") from None
    name = f"{split}/tokens"
    _refuse_outside(f, path, split)
    if name not in f or not hasattr(f[name], "shape"):
        groups = ", ".join(sorted(k for k in f if hasattr(f[k], "keys"))) or "none"
        f.close()
        raise DataSpecError(f"text data file '{path}' has no dataset '/{name}' (groups: "
                            f"{groups}); check the data spec's 'split' (train or val), or make "
                            "the file with 'python -m purine_mpi data text'", "split")
    tokens = f[name]
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        # the message read before the file closes: after, its shape was
        # 'RuntimeError: Unable to synchronously get dataspace', exit 1
        message = (f"text data file '{path}': dataset '/{name}' must be 1-D integer "
                   f"tokens, got shape {list(tokens.shape)} dtype {tokens.dtype}")
        f.close()
        raise UserError(message)
    return f, tokens


def _refuse_outside(f, path, split):
    """Close ``f`` and raise a UserError when the split's group or its
    tokens read from another file (an external link, external storage, a
    virtual dataset, a soft link that leads nowhere or through an external
    link: data/h5links.py): a text data file holds its own tokens (a
    virtual dataset whose source is missing would read as zeros); no other
    file is opened to find this out."""
    import h5py
    for name in (f"/{split}", f"/{split}/tokens"):
        parent, _, base = name.rpartition("/")
        try:
            group = f[parent or "/"]
            there = isinstance(group, h5py.Group) and group.get(base, getlink=True) is not None
            why = link_outside(f, name) if there else None
        except (OSError, KeyError, RuntimeError, ValueError) as e:  # damaged headers
            f.close()
            raise UserError(f"text data file '{path}' is corrupt: {type(e).__name__}: "
                            f"{one_line(e)}") from None
        if not there:
            return  # a missing name: the caller says which
        if why:
            f.close()
            raise UserError(f"text data file '{path}': '{name}' is {one_line(why)}; a text data "
                            "file must hold its own tokens: make it with 'python -m purine_mpi "
                            "data text'")


#: per split, the one reader of its tokens' metadata (data/filecache.py
#: keys its cache on the reader)
_META_READERS = {}


def _tokens_meta(path, split):
    """(tokens, bytes per token) of the split's token dataset, read once per
    process and file version (data/filecache.py): every graph a job
    composes infers its data op's shape from it (the start-up, ``plan``,
    ``choose``: an HDF5 open each, 20% of composing a tensor x pipeline
    job's 8 ranks); a file that fails is opened again, its error each time."""
    read = _META_READERS.get(split)
    if read is None:
        read = _META_READERS.setdefault(split, functools.partial(_read_tokens_meta, split=split))
    return per_file_version(path, read, digest=INFO_DIGEST_BYTES)  # metadata only


def _read_tokens_meta(path, split):
    f, tokens = _open_tokens(path, split)
    with f:
        return int(tokens.shape[0]), tokens.dtype.itemsize


def text_info(spec):
    """(n_samples, sample_shape) of a text spec, reading only metadata."""
    n_tokens, _ = _tokens_meta(spec["path"], spec.get("split") or "train")
    return _count(spec, n_tokens), (int(spec["sequence_length"]),)


def text_resident_bytes(spec):
    """Bytes a ``TextSource`` of ``spec`` holds from its construction on
    (its tokens, in the file's dtype, and the window offsets), reading
    only metadata."""
    n_tokens, itemsize = _tokens_meta(spec["path"], spec.get("split") or "train")
    return n_tokens * itemsize + (int(spec["sequence_length"]) + 1) * 8


def _count(spec, n_tokens):
    length = int(spec["sequence_length"])
    if n_tokens < length + 1:
        raise DataSpecError(f"text data file '{spec['path']}': split '{spec.get('split')}' "
                            f"holds {n_tokens} tokens, fewer than sequence_length + 1 = "
                            f"{length + 1}: use a shorter sequence_length or more text",
                            "sequence_length")
    return (n_tokens - length - 1) // window_stride(spec) + 1


class TextSource:
    """A split of a text file as windows (module docstring); the tokens are
    held in memory (one byte each)."""

    def __init__(self, spec):
        self.path, self.split = spec["path"], spec.get("split") or "train"
        self.length, self.stride = int(spec["sequence_length"]), window_stride(spec)
        f, tokens = _open_tokens(self.path, self.split)
        with f:
            try:
                self.tokens = np.ascontiguousarray(tokens[...])
            except OSError as e:
                raise UserError(f"text data file '{self.path}': reading '/{self.split}/tokens' "
                                f"failed ({e}); the file may be truncated") from None
        self.n_samples = _count(spec, len(self.tokens))
        self.sample_shape = (self.length,)
        self._offsets = np.arange(self.length + 1, dtype=np.int64)

    def gather(self, indices):
        """(data (k, T) int32, labels (k, T) int32) of the windows ``indices``."""
        starts = np.asarray(indices, dtype=np.int64) * self.stride
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    def gather_labels(self, indices):
        """The labels (k, T) int32 of the windows ``indices`` (``gather``'s),
        without their data."""
        starts = np.asarray(indices, dtype=np.int64) * self.stride + 1
        return self.tokens[starts[:, None] + self._offsets[:-1]].astype(np.int32)

    def max_token(self):
        return int(self.tokens.max()) if len(self.tokens) else 0

    def min_token(self):
        """The smallest token (0 when none): below 0 only in a signed dtype,
        where an embedding would read it as a row from the end."""
        if not len(self.tokens) or self.tokens.dtype.kind == "u":
            return 0
        return int(self.tokens.min())
