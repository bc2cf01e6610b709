"""HDF5 checkpoints (docs/formats.md, "Checkpoints").

    /                 attrs: format = "purine_mpi.checkpoint", version = 1,
                      iteration, world_size, seed, config (YAML text),
                      run_id, elapsed (training seconds so far: metrics' "time")
    /params/<name>    every learnable blob (``conv1/weight`` -> /params/conv1/weight)
    /solver/<name>/…  solver state per parameter (e.g. ``momentum``)
    /state/…          RNG states, data positions: whatever a resumed run needs

Values round-trip exactly: arrays keep their dtype and bits, nested dicts
their structure. How a value is stored (the ``purine_kind`` attribute says
which, so files stay readable with ``h5ls -r`` / ``h5dump``):

    numpy array                -> dataset (no attribute: any plain dataset reads as an array)
    numpy scalar               -> 0-d dataset, kind "scalar"
    dict holding numpy values  -> group, kind "dict" (a '/' in a key nests groups)
    anything JSON can hold     -> string dataset of JSON text, kind "json"
                                  (ints of any size, e.g. RNG states; tuples come back as lists)

Every write goes to ``<path>.tmp.<pid>``, is flushed and fsynced, then
renamed over ``path``, so a crash never leaves a partial checkpoint under the
final name.
"""
import contextlib
import copy
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field

import numpy as np

from ..base.backend import to_numpy
from ..base.errors import UserError, one_line
from ..base.runfiles import GuardedFile, disk_error, folder_of, make_parent, write_failed
from .checkpoint_check import (Unchecked, _plain, check_attrs, check_layout, names_the_file,
                               plain_attr)
from ..data.h5links import held_by, is_lock_error, refuse_outside

FORMAT = "purine_mpi.checkpoint"
VERSION = 1
KIND = "purine_kind"
LATEST = "latest.h5"
CHECKSUM = "sha256"  # attribute of /state: its datasets have no Fletcher-32 of their own
#: HDF5's chunk cache of a checkpoint or weights file, read or written
#: (``rdcc_nbytes``): none. Every chunk is read or written once, whole, so
#: the cache (8 MiB a dataset by default) only held chunks that the heap
#: then kept: reading a 65 MiB checkpoint added 9.2 MiB above its arrays
#: with it, 3.1 without (docs/running.md, "Will it fit?")
CHUNK_CACHE_BYTES = 0
#: HDF5's metadata cache of the same files (object headers, chunk indexes):
#: a fixed size, not the default's adaptive 1-32 MiB, which grew with the
#: datasets a save wrote (1,200 of them: 16 MiB) and stayed
METADATA_CACHE_BYTES = 256 << 10
#: a checkpoint's array larger than this is written a slab of rows at a
#: time: HDF5 holds a few KiB per chunk a write touches until it ends (its
#: chunk map), 16.7 MiB for a 256 MiB array written whole (4,096 chunks of
#: 64 KiB), 2 MiB in slabs of this size (docs/running.md, "Will it fit?")
WRITE_SLAB_BYTES = 4 << 20


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``params`` {name: array}, ``solver`` {name: {key:
    array}}, ``state`` (nested), ``attrs`` (root attributes as Python values)."""

    path: str
    params: dict = field(default_factory=dict)
    solver: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    #: the run read it for itself (train/trainer.run_training): ``loaded``
    #: lets its arrays go once the weights are set, so the run does not hold
    #: a second copy of the model and its solver state to its end
    transient: bool = False

    @property
    def iteration(self):
        return int(self.attrs.get("iteration", 0))

    def loaded(self):
        """The weights and solver state are set from it: a ``transient``
        checkpoint drops its arrays (``params``, ``solver``; the small
        ``state`` and ``attrs`` stay)."""
        if self.transient:
            self.params, self.solver = {}, {}


# -------------------------------------------------------------------- write
class Streamed:
    """A section (``/params``, ``/solver``) whose ``(key, value)`` pairs
    come one at a time as the file is written, in the order they are
    written (a sharded save gathers each bucket as its turn comes:
    parallel/schemes/sharded.py): ``items()`` runs ``pairs``, once. The
    file is the one the same pairs in a dict make."""

    def __init__(self, pairs):
        self._pairs = pairs

    def items(self):
        pairs, self._pairs = self._pairs, ()
        return pairs


#: the temp files this process is writing now (``remove_temp_files``)
_IN_PROGRESS = set()


def remove_temp_files():
    """Delete the temp files of the writes in progress: called by a process
    that ends at once (a second Ctrl-C, runtime/stop.py) in the middle of a
    checkpoint, so no half-written ``*.h5.tmp.<pid>`` is left behind."""
    for tmp in list(_IN_PROGRESS):
        try:
            os.remove(tmp)
        except OSError:
            pass
        _IN_PROGRESS.discard(tmp)


@contextlib.contextmanager
def replaced_atomically(path):
    """Yield a temporary name beside ``path``; when the block succeeds, fsync
    it, rename it over ``path`` and fsync the folder, so a crash leaves
    either the old file or the complete new one. On failure the temporary
    file is removed, whatever the failure (a full disk, the file-size limit:
    a UserError naming the file; another error of the disk names it too).
    A link at ``path`` is replaced, never written through."""
    directory = folder_of(path)  # the folder the rename is in (link/.. resolved)
    tmp = f"{path}.tmp.{os.getpid()}"
    if os.path.lexists(tmp):
        os.remove(tmp)
    _IN_PROGRESS.add(tmp)
    try:
        yield tmp
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_path(directory)
    except BaseException as exc:
        if os.path.lexists(tmp):
            os.remove(tmp)
        if isinstance(exc, OSError) and disk_error(path, exc) is not None:
            raise disk_error(path, exc) from None
        if isinstance(exc, OSError) and exc.errno and not exc.filename:
            # a write's error (os.write names no file): the runtime failure's line names it
            raise OSError(exc.errno, exc.strerror, path) from None
        raise
    finally:
        _IN_PROGRESS.discard(tmp)


def save_checkpoint(path, params, solver=None, state=None, iteration=0, world_size=1, seed=0,
                    config_text="", run_id="", elapsed=None, tokenizer=None):
    """Write a checkpoint atomically (temp file, fsync, rename, fsync dir);
    ``tokenizer``: the JSON of the vocabulary of the run's token data
    (data/tokenizer.py), kept as the dataset ``/tokenizer``."""
    import h5py
    path = str(path)
    make_parent(path)
    with replaced_atomically(path) as tmp, GuardedFile(tmp) as raw:
        # HDF5 writes through ``raw`` (created anew, never through a link): a
        # full disk is one line naming the file, not HDF5's errors
        with h5py.File(raw, "w", track_order=True, rdcc_nbytes=CHUNK_CACHE_BYTES) as f:
            small_metadata_cache(f)
            f.attrs["format"] = FORMAT
            f.attrs["version"] = VERSION
            f.attrs["iteration"] = int(iteration)
            f.attrs["world_size"] = int(world_size)
            f.attrs["seed"] = int(seed)
            f.attrs["config"] = str(config_text or "")
            if run_id:  # the run (and its resumes) that wrote it: rotation keeps to its own
                f.attrs["run_id"] = str(run_id)
            if elapsed is not None:  # metrics.jsonl's "time" continues from it on resume
                f.attrs["elapsed"] = float(elapsed)
            for section, values in (("params", params), ("solver", solver), ("state", state)):
                _write_dict(f.create_group(section, track_order=True), values or {}, section)
            # the digest of what a reader gets back, so JSON-held values
            # (positions, RNG states) are covered exactly as they will be read
            f["state"].attrs[CHECKSUM] = state_digest(_read_group(f["state"], ["state"]))
            if tokenizer:  # generate decodes with it: the checkpoint alone suffices
                from ..data.tokenizer import write_json
                write_json(f, tokenizer)
            f.flush()
        raw.check()
    return path


def small_metadata_cache(f):
    """Fix the metadata cache of the open file ``f`` at ``METADATA_CACHE_BYTES``."""
    config = f.id.get_mdc_config()
    config.set_initial_size = True
    config.initial_size = config.min_size = config.max_size = METADATA_CACHE_BYTES
    config.incr_mode = config.flash_incr_mode = config.decr_mode = 0  # off: the size stays
    f.id.set_mdc_config(config)


def _write_dict(group, values, where):
    if not isinstance(values, (dict, Streamed)):
        raise TypeError(f"checkpoint: {where} must be a dict, got {type(values).__name__}")
    for key, value in values.items():
        if write_failed():  # a full disk: the rest is not written (a Streamed section is
            continue        # still drained: the other ranks' gathers go on in their order)
        _write_value(group, key, value, f"{where}/{key}")


def _write_value(group, key, value, where):
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/") \
            or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"checkpoint: cannot store key {key!r} at {where}: keys must be "
                         "non-empty strings of '/'-separated names")
    parent, _, name = key.rpartition("/")
    if parent:  # a '/' in a key nests plain groups (read back as part of the key)
        for part in parent.split("/"):
            group = group[part] if part in group else group.create_group(part, track_order=True)
    if hasattr(value, "__cuda_array_interface__"):
        value = to_numpy(value)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.kind in "UM":
            raise TypeError(f"checkpoint: {where} has dtype {value.dtype}, which HDF5 cannot "
                            "hold; store numbers, or a list of strings (JSON)")
        # a Fletcher-32 checksum per chunk turns silent corruption into a read error
        checksum = value.ndim > 0 and value.size > 0
        if not checksum or value.nbytes <= WRITE_SLAB_BYTES:
            group.create_dataset(name, data=value, fletcher32=checksum)
            return
        # the same chunks (h5py guesses them from the shape), written a slab at a time
        dset = group.create_dataset(name, shape=value.shape, dtype=value.dtype, fletcher32=True)
        rows = max(1, WRITE_SLAB_BYTES // max(1, value[:1].nbytes))
        for i in range(0, value.shape[0], rows):
            if write_failed():  # a full disk: the rest of it is not written
                break
            dset[i:i + rows] = value[i:i + rows]
    elif isinstance(value, np.generic):
        group.create_dataset(name, data=np.asarray(value)).attrs[KIND] = "scalar"
    elif isinstance(value, dict) and not _json_pure(value):
        sub = group.create_group(name, track_order=True)
        sub.attrs[KIND] = "dict"
        _write_dict(sub, value, where)
    elif _json_pure(value):
        import h5py
        text = json.dumps(value)
        group.create_dataset(name, data=text, dtype=h5py.string_dtype()).attrs[KIND] = "json"
    else:
        raise TypeError(f"checkpoint: cannot store {where} of type {type(value).__name__}; "
                        "use numpy arrays, numbers, strings, lists and dicts")


def state_digest(values):
    """SHA-256 (hex) of a nested dict as read back from a checkpoint: keys in
    sorted order, arrays by dtype, shape and bytes, other values as JSON."""
    h = hashlib.sha256()

    def feed(value):
        if isinstance(value, dict):
            h.update(b"{")
            for key in sorted(value):
                h.update(json.dumps(key).encode() + b":")
                feed(value[key])
            h.update(b"}")
        elif isinstance(value, (np.ndarray, np.generic)):
            value = np.ascontiguousarray(value)
            h.update(f"a{value.dtype.str}{list(value.shape)}".encode())
            h.update(value.tobytes())
        else:
            h.update(b"j" + json.dumps(value, sort_keys=True).encode())
    feed(values)
    return h.hexdigest()


def _json_pure(value):
    """True when JSON holds ``value`` exactly (numpy values excluded: they
    keep their dtype as datasets)."""
    if isinstance(value, np.generic):
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_pure(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_pure(v) for k, v in value.items())
    return False


def _fsync_path(path):
    """fsync a file or a directory (so a rename is durable); best effort
    where the platform cannot open directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------- read
class FileHeld(UserError):
    """The file is held open by another process (HDF5's file lock): not damaged."""


def open_h5(path, what="checkpoint", links=None):
    """Open an HDF5 file for reading, or raise a UserError that says why not:
    missing, not HDF5, held by another process (``FileHeld``), truncated or
    corrupt, or not self-contained (a dataset or link that reads from
    another file: data/h5links.py; ``links``, a dict, receives that walk's
    datasets and soft links: ``outside_reference``)."""
    import h5py
    path = str(path)
    if not os.path.exists(path):
        raise UserError(f"{what} '{path}' not found")
    if os.path.isdir(path):
        raise UserError(f"{what} '{path}' is a directory, not an HDF5 file")
    mode = os.stat(path).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise UserError(f"{what} '{path}' is a pipe or socket, not an HDF5 file")  # (open waits)
    try:  # HDF5 calls a file it may not read "not HDF5" or a failed read
        with open(path, "rb"):
            pass
    except OSError as e:
        raise UserError(f"{what} '{path}' cannot be read: {e.strerror or e}") from None
    try:
        f = h5py.File(path, "r", rdcc_nbytes=CHUNK_CACHE_BYTES)
    except OSError as e:
        if is_lock_error(e):
            holder = held_by(path) or _run_lock_holder(path)
            if holder or "already open for write" not in str(e):
                raise FileHeld(f"{what} '{path}' is held open by another process ("
                               f"{holder or 'HDF5 file lock'}); the file is not damaged, HDF5 "
                               "refuses to read it while that process may be writing it: let "
                               "that process finish or stop it, then run again") from None
            raise FileHeld(f"{what} '{path}' is marked as open for writing (HDF5's file "
                           "consistency flag): another process is writing it, or one died "
                           "while writing it; if no process is, `h5clear -s` clears the mark "
                           f"({e})") from None
        if not h5py.is_hdf5(path):
            raise UserError(f"{what} '{path}' is not an HDF5 file") from None
        raise UserError(f"{what} '{path}' is truncated or corrupt and cannot be opened "
                        f"({e})") from None
    try:
        small_metadata_cache(f)
        refuse_outside(f, path, what, links)
    except (OSError, KeyError, RuntimeError, ValueError) as e:  # damaged links or headers
        f.close()
        raise UserError(f"{what} '{path}' is corrupt: {type(e).__name__}: {e}") from None
    except BaseException:
        f.close()
        raise
    return f


def _run_lock_holder(path):
    """What the run folder's lock file says of the run holding it, if that
    is not this process ('' otherwise)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), ".purine.lock"),
                  encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return ""
    if not text or text.startswith(f"pid {os.getpid()} ") or text.startswith("free:"):
        return ""  # no run, this one, or one that has ended (job/rundir.py)
    return f"the run: {text}"


def _check_header(f, path):
    """The root attributes and layout of the open checkpoint ``f`` checked
    (format, version, ``check_attrs``, ``check_layout``): no array is read.
    Returns (attrs, the digest /state is verified against)."""
    attrs = read_attrs(f)
    if attrs.get("format") != FORMAT:
        raise UserError(f"'{path}' is not a purine_mpi checkpoint: its root attribute "
                        f"'format' is {attrs.get('format')!r}, expected {FORMAT!r}")
    version = attrs.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise UserError(f"checkpoint '{path}' has format version {version!r}; this "
                        f"purine_mpi reads version {VERSION} and older")
    check_attrs(attrs, path)
    return attrs, check_layout(f, path, CHECKSUM)  # /params, /state and its digest


@names_the_file("checkpoint")
def checkpoint_header(path):
    """A checkpoint's root attributes, after the checks ``load_checkpoint``
    makes of its metadata (missing, not HDF5, foreign, of a later version,
    attributes out of range, groups missing): the same UserErrors, with no
    array read, so a refusal that needs only these costs no read of a file
    of gigabytes."""
    with open_h5(path) as f:
        return _check_header(f, path)[0]


@names_the_file("checkpoint")
def load_checkpoint(path):
    """Read a whole checkpoint. Raises UserError (naming the file and what is
    wrong) for a missing, non-HDF5, truncated, damaged, edited or foreign file."""
    with open_h5(path) as f:
        attrs, expected = _check_header(f, path)
        sections = {}  # /params and /solver were written with Fletcher-32 checksums
        for section in ("params", "solver", "state"):
            sections[section] = _read_section(f, section, path, section != "state") \
                if section in f else {}
    if state_digest(sections["state"]) != expected:
        raise UserError(f"checkpoint '{path}' is corrupt: '/state' (data position, random "
                        "streams) does not match its checksum; it was damaged or edited")
    return Checkpoint(str(path), attrs=attrs, **sections)


def load_solver(path):
    """The ``/solver`` section of the checkpoint ``path`` alone ({param:
    {key: array}}; {} where it has none): a parameter-server run's rank 0
    saving the state it resumed from before any update (train/ps_worker.py),
    without reading the weights again."""
    with open_h5(path) as f:
        return _read_section(f, "solver", path, True) if "solver" in f else {}


@names_the_file("weights file")
def load_params(path):
    """The ``/params`` of any HDF5 file with the checkpoint layout (``--init``):
    {name: array}; other groups and attributes are optional."""
    with open_h5(path, "weights file") as f:
        _params_group(f, path)
        return _read_section(f, "params", path, what="weights file")


def _params_group(f, path):
    """``f``'s /params group; a UserError naming ``path`` where it has none
    (a data file given as weights, for one)."""
    if "params" not in f or not hasattr(f["params"], "keys"):
        raise UserError(f"weights file '{path}' has no /params group; expected the "
                        "checkpoint layout (/params/<layer>/weight, ...)")
    return f["params"]


@names_the_file("weights file")
def params_nbytes(path):
    """The bytes ``load_params`` reads into memory from ``path``: its
    ``/params`` datasets' sizes (their metadata: no data is read), each
    name counted as ``load_params`` reads it (a dataset under two names,
    through an alias of a group too, twice: an object walk counted it
    once). A file with no /params is refused as ``load_params`` refuses it
    (``plan --init DATA.h5`` said it fits, where train exits 2), and so is
    a group that is an alias of one of its own parents."""
    with open_h5(path, "weights file") as f:
        return _group_nbytes(_params_group(f, path), "params", _root(f))


def _group_nbytes(group, where, above=(), done=None):
    """The bytes of the datasets under ``group`` (``where``: its name), by
    name (``_Reader.walk``'s walk and its refusal of a cycle); ``done``: the
    total of each group already counted (the hash of its id: its object),
    taken again under its other names, so that groups each linking twice to
    the next (2**n names in n groups) cost n looks, not 2**n."""
    import h5py
    done = {} if done is None else done
    key = hash(group.id)
    if key in done:  # counted in full, no cycle below it (that would have ended the count)
        return done[key]
    above = above + ((key, f"/{where}"),)
    total = 0
    for name in group:
        obj = group[name]
        if isinstance(obj, h5py.Group):
            _not_a_parent(obj, above, f"{where}/{name}")
            total += _group_nbytes(obj, f"{where}/{name}", above, done)
        elif isinstance(obj, h5py.Dataset):
            total += (obj.size or 0) * obj.dtype.itemsize
    done[key] = int(total)
    return done[key]


def _root(f):
    """``above`` of a top-level group of the open file ``f``: the root, so
    that a name under it linking back to the root is refused there, under
    its own name, before the root's other groups are read through it."""
    return ((hash(f["/"].id), "/"),)


def _not_a_parent(group, above, where):
    """A ValueError naming ``where`` when ``group`` is one of ``above``
    ((hash of its id, its name) of the groups on the way to it): a group
    hard-linked into itself or its child, a cycle of names without end."""
    parent = next((n for h, n in above if h == hash(group.id)), None)
    if parent is not None:
        raise ValueError(f"'/{one_line(where)}' is an alias of '{one_line(parent)}', one of its "
                         "own parents (a cycle of links)")


@names_the_file("weights file")
def saved_config_text(path):
    """The config text a weights file was written with (its root attribute
    ``config``; '' when it has none)."""
    with open_h5(path, "weights file") as f:
        text = plain_attr(f.attrs.get("config"))
    return text if isinstance(text, str) else ""


@names_the_file("weights file")
def saved_tokenizer(path):
    """The vocabulary JSON a weights file holds (``/tokenizer``, written
    when the run's token data has one), or None (byte-level)."""
    from ..data.tokenizer import check_stored, read_stored
    with open_h5(path, "weights file") as f:
        text, want = read_stored(f)
    if text is not None:  # generate decodes with it, export hf writes it as tokenizer.json
        check_stored(text, want, f"weights file '{path}'")
    return text


def _read_section(f, section, path, checksummed=False, what="checkpoint"):
    where = [section]
    try:
        reader = _Reader(checksummed)
        names = reader.walk(f[section], where, _root(f))
    except Unchecked as e:
        raise e.user_error(path) from None
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:
        raise UserError(f"checkpoint '{path}' is corrupt: reading '/{one_line(where[-1])}' "
                        f"failed ({type(e).__name__}: {one_line(e)})") from None
    if names > MAX_SECTION_NAMES:  # counted, never listed: 2**n names in n groups
        raise UserError(f"{what} '{path}' is refused: '/{section}' holds {names:,} names "
                        f"through second names (hard or soft links) of its "
                        f"{len(reader.groups):,} groups, more than the {MAX_SECTION_NAMES:,} a "
                        "section may hold; a purine_mpi file names each value once")
    stored, given = sum(reader.nbytes.values()), reader.bytes[hash(f[section].id)]
    if given - stored > max(stored, MIN_COPY_BYTES):
        raise UserError(f"{what} '{path}' is refused: '/{section}' holds {given:,} bytes of "
                        f"values under all their names (second names, hard or soft links, "
                        f"each get a copy) for {stored:,} bytes stored; the copies may be at "
                        f"most the bytes stored (or {MIN_COPY_BYTES:,}); a purine_mpi file "
                        "names each value once")
    return reader.values(f[section])


#: the most names (values, as a read returns them) one section of a
#: checkpoint or weights file (/params, /solver, /state) may hold; a big
#: net has a few thousand. A group hard-linked under several names has its
#: names under each: groups each linking twice to the next hold 2**n names
#: in n groups, which are counted (each group looked at once) and refused
MAX_SECTION_NAMES = 100_000

#: the copies a section's second names cost are bounded too: at most the
#: bytes its datasets hold (or this many bytes, whichever is more), so that
#: one big dataset under many names (100 MB under 1,000 names: 100 GB of
#: copies, within MAX_SECTION_NAMES) is refused before any copy is made
MIN_COPY_BYTES = 1 << 20


class _Reader:
    """One section's read: ``walk`` looks at each group once (by its
    address: the hash of its id), reads each dataset once, refuses a group
    that is an alias of one of its own parents (a cycle) and counts the
    names (values) the section holds; ``values`` then makes {name: value}
    from what the walk kept, a value under a second name a copy of the
    first (a caller may change one in place)."""

    def __init__(self, checksummed):
        self.checksummed = checksummed
        self.groups = {}   # group's key: [(name, what, key or value)], what "group", "dict", "data"
        self.counts = {}   # group's key: its names
        self.read = {}     # dataset's key: its value
        self.nbytes = {}   # dataset's key: the bytes of its value (read once)
        self.bytes = {}    # group's key: the bytes of its values under all their names

    def walk(self, group, where, above=()):
        """The names under ``group`` (``where``, a list, ends with its name:
        the error's); ``above``: (key, name) of the groups on the way."""
        import h5py
        key = hash(group.id)
        if key in self.counts:  # walked in full (a cycle below it would have ended it)
            return self.counts[key]
        above = above + ((key, f"/{where[-1]}".rstrip("/") or "/"),)
        entries, total, nbytes = [], 0, 0
        for name in group:
            where.append(f"{group.name.lstrip('/')}/{name}")
            obj = group[name]
            kind = plain_attr(obj.attrs.get(KIND))
            if isinstance(obj, h5py.Group):
                _not_a_parent(obj, above, where[-1])
                count = self.walk(obj, where, above)
                what = "dict" if kind == "dict" else "group"
                entries.append((name, what, hash(obj.id)))
                # a dict's names are expanded as a plain group's are (``values``):
                # counted alike, so a dict over a chain of doubling groups is
                # refused as the plain chain is (it counted as one name)
                total += max(count, 1) if what == "dict" else count
                nbytes += self.bytes[hash(obj.id)]
            else:
                dkey = hash(obj.id)
                if dkey not in self.read:
                    if self.checksummed and kind is None and obj.ndim > 0 and obj.size > 0 \
                            and not obj.fletcher32:
                        raise Unchecked(where[-1])
                    self.read[dkey] = _read_dataset(obj, kind)
                    self.nbytes[dkey] = int(obj.size or 0) * obj.dtype.itemsize
                entries.append((name, "data", dkey))
                total += 1
                nbytes += self.nbytes[dkey]
            where.pop()
        self.groups[key], self.counts[key], self.bytes[key] = entries, total, nbytes
        return total

    def values(self, group):
        """{name: value} of the walked ``group``, as ``_read_group`` gives them."""
        out = {}
        self._fill(hash(group.id), "", out, set())
        return out

    def _fill(self, key, prefix, into, given):
        """``into`` given the values under the walked group ``key``, names
        after ``prefix``; a dataset already in ``given`` is copied. A method,
        not a closure inside ``values``: a recursive closure is a cycle (the
        function, its cell) that held this reader and every array it read
        until the next garbage collection, so a load's arrays outlived their
        caller (tests/test_plan_rss.py: a second load measured 0.5 MB)."""
        for name, what, below in self.groups[key]:
            if what == "group":  # a plain group: a '/' inside the names below
                self._fill(below, f"{prefix}{name}/", into, given)
            elif what == "dict":
                into[prefix + name] = sub = {}
                self._fill(below, "", sub, given)
            else:
                value = self.read[below]
                if below in given:
                    value = copy.deepcopy(value)
                given.add(below)
                into[prefix + name] = value


def _read_group(group, where):
    """The values under ``group`` ({name: value}); ``where``, a list, ends
    with the name being read (for the error). Each group is looked at once
    and each dataset read once, and a group hard-linked into itself (a
    cycle, which no file we write has) is an error, not a recursion without
    end (``_Reader``)."""
    reader = _Reader(False)
    reader.walk(group, where)
    return reader.values(group)


def _read_dataset(dset, kind):
    if kind == "json":
        return json.loads(dset.asstr()[()])
    if kind == "scalar":
        return dset[()]
    if dset.dtype.kind in "SO":  # a plain string dataset written by another tool
        value = dset.asstr()[()]
        return value if isinstance(value, str) else np.asarray(value)
    return np.asarray(dset[...])


def read_attrs(obj):
    """An HDF5 object's attributes as plain Python values."""
    return {k: _plain(v) for k, v in obj.attrs.items()}
