"""Validation of the config's data specs (``data.train``, ``data.test``):
sources (hdf5, lmdb, text, synthetic), paths resolved against the working and the config's folder, the
transform keys, the notes a user should read, and the hint that names the
command which makes a missing data file. Imports the schema and checks.
"""
import os

from ..base.errors import ConfigError, DataSpecError, UserError, excerpt
from ..data.sources import data_hint
from .checks import _check_choice, _check_keys, _is_int, _is_number, _kind
from .inputs import data_file_digest
from .schema import DATA_CHECKS, DATA_KEYS, DATA_SOURCES, SYNTHETIC_NUM_SAMPLES


# ---------------------------------------------------------------- data specs
def _check_data(data, path, check_files):
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(path, "data", f"expected a mapping with 'train' and/or 'test', "
                                        f"got {_kind(data)}")
    _check_keys("data", data, ("train", "test"), path)
    return {split: _check_data_spec(split, spec, path, check_files)
            for split, spec in data.items() if spec is not None}


def _check_data_spec(phase, spec, path, check_files):
    key = f"data.{phase}"
    if not isinstance(spec, dict):
        raise ConfigError(path, key, f"expected a mapping (source, path, split, batch_size, ...), "
                                     f"got {_kind(spec)}")
    _check_keys(key, spec, DATA_KEYS, path)
    source = spec.get("source")
    if source is None:  # infer the obvious case, so a path alone is enough
        source = (("lmdb" if isinstance(spec["path"], str) and os.path.isdir(spec["path"])
                   else "hdf5") if "path" in spec else "synthetic" if "shape" in spec else None)
    if source is None:
        raise ConfigError(path, f"{key}.source", "expected 'hdf5' or 'lmdb' (with a path) or "
                                                 "'synthetic' (with shape and classes)")
    out = {"source": _check_choice(f"{key}.source", source, DATA_SOURCES, path)}
    if "batch_size" not in spec:
        raise ConfigError(path, f"{key}.batch_size", "missing; expected a positive integer "
                                                     "(the per-rank batch size)")
    out["batch_size"] = _checked(key, "batch_size", spec["batch_size"], path)
    out["shuffle"] = _checked(key, "shuffle", spec.get("shuffle", phase == "train"), path)
    if spec.get("seed") is not None:
        out["seed"] = _checked(key, "seed", spec["seed"], path)
    out.update(_check_transform(key, spec, path, check_files))
    if source == "lmdb":
        if not isinstance(spec.get("path"), str) or not spec["path"]:
            raise ConfigError(path, f"{key}.path", "expected the path of a Caffe LMDB (the "
                                                   f"folder holding data.mdb), got "
                                                   f"{excerpt(spec.get('path'))}")
        for other in ("in_memory", "external", "split", "shape", "classes", "num_samples"):
            if spec.get(other) is not None:
                raise ConfigError(path, f"{key}.{other}", "does not apply to source lmdb "
                                                          "(one database is one split)")
        out["path"] = _resolve_data_path(spec["path"], path, f"{key}.path", check_files,
                                         folder=True)
    elif source == "text":
        out.update(_check_text(key, spec, phase, path, check_files))
    elif source == "hdf5":
        if not isinstance(spec.get("path"), str) or not spec["path"]:
            raise ConfigError(path, f"{key}.path", "expected the path of an HDF5 file, got "
                                                   f"{excerpt(spec.get('path'))}")
        out["path"] = _resolve_data_path(spec["path"], path, f"{key}.path", check_files)
        in_memory = spec.get("in_memory", "auto")
        if in_memory not in ("auto", True, False):
            raise ConfigError(path, f"{key}.in_memory", "expected auto (load the split when it "
                              "fits in a quarter of the memory), true or false (read each "
                              f"batch from the file), got {excerpt(in_memory)}")
        out["in_memory"] = in_memory
        out["external"] = _checked(key, "external", spec.get("external", False), path)
        split = spec.get("split")
        if split is not None and (not isinstance(split, str) or not split):
            raise ConfigError(path, f"{key}.split",
                              f"expected a group name such as 'train', or null for top-level "
                              f"data/label, got {excerpt(split)}")
        out["split"] = split
    else:
        shape = spec.get("shape")
        if (not isinstance(shape, list) or not shape
                or not all(_is_int(s) and s > 0 for s in shape)):
            raise ConfigError(path, f"{key}.shape", "expected a list of positive integers "
                                                    f"[C, H, W] (one sample), got {excerpt(shape)}")
        out["shape"] = [int(s) for s in shape]
        if "classes" not in spec:
            raise ConfigError(path, f"{key}.classes", "missing; synthetic data needs the "
                                                      "number of classes (a positive integer)")
        out["classes"] = _checked(key, "classes", spec["classes"], path)
        out["num_samples"] = _checked(key, "num_samples",
                                      spec.get("num_samples", SYNTHETIC_NUM_SAMPLES), path)
        out["split"] = spec.get("split", phase)
        if spec.get("path") is not None:  # ignored: kept for data_notes' word on it
            out["path"] = str(spec["path"])
    return out


def _check_text(key, spec, phase, path, check_files):
    """The text source's keys (data/text.py): a token file, its split, the
    window length; no transform and no hdf5/synthetic keys."""
    for other in ("in_memory", "external", "shape", "classes", "num_samples", "mean",
                  "mean_file", "scale", "mirror", "crop_size"):
        if spec.get(other) is not None:
            raise ConfigError(path, f"{key}.{other}", "does not apply to source text (byte "
                                                      "tokens: no transform)")
    if not isinstance(spec.get("path"), str) or not spec["path"]:
        raise ConfigError(path, f"{key}.path", "expected the path of a token file of 'python "
                                               "-m purine_mpi data text', got "
                                               f"{excerpt(spec.get('path'))}")
    split = spec.get("split", "train" if phase == "train" else "val")
    if split not in ("train", "val"):
        raise ConfigError(path, f"{key}.split", f"expected train or val, got {excerpt(split)}")
    if "sequence_length" not in spec:
        raise ConfigError(path, f"{key}.sequence_length", "missing; the text source needs the "
                                                          "tokens per sample (a positive "
                                                          "integer)")
    return {"path": _resolve_data_path(spec["path"], path, f"{key}.path", check_files,
                                       what="text data file"),
            "split": split,
            "sequence_length": _checked(key, "sequence_length", spec["sequence_length"], path)}


def _checked(spec_key, name, value, path):
    """``value`` of the data spec key ``name`` through its declared checker."""
    return DATA_CHECKS[name](f"{spec_key}.{name}", value, path)


def data_notes(job):
    """One line for each data split of ``job`` (job/job.py) whose batch is
    larger than the split (each batch then holds samples several times over:
    a mistyped batch_size, or a small stand-in file), and for a synthetic
    split given a ``path`` (ignored: a leftover of an hdf5 spec, or a
    forgotten ``source``). Reads the HDF5 files' metadata."""
    from ..data.sources import source_info
    from .schema import SOURCE_KEYS
    notes = []
    in_file = f"{job.path}: " if job.path and not str(job.path).startswith("<") else ""
    for phase, spec in job.data.items():
        if spec.source == "synthetic" and spec.path is not None:
            notes.append(f"note: data.{phase}.path {spec.path!r} is ignored: source synthetic "
                         f"makes random samples of data.{phase}.shape; set source: hdf5 (or "
                         "lmdb) to read the file, or drop the path")
        ignored = [entry for entry in job.ignored_data_keys or () if entry[0] == phase]
        for where in dict.fromkeys(entry[3] for entry in ignored):  # the file, then each --set
            mine = [(key, value) for _, key, value, by in ignored if by == where]
            keys = ", ".join(f"data.{phase}.{key} {excerpt(value)}" for key, value in mine)
            said = f"--set {excerpt(where, quote=False)}: " if where is not None else in_file
            own = ", ".join(SOURCE_KEYS.get(spec.source, ()))
            verb, them = ("is", "it") if len(mine) == 1 else ("are", "them")
            notes.append(f"note: {said}{keys} {verb} not read by source {spec.source} (it "
                         f"reads {own}, besides batch_size, shuffle, seed and the transform): "
                         f"{'a key' if them == 'it' else 'keys'} of another source; drop "
                         f"{them}, or set the source "
                         f"{'it belongs' if them == 'it' else 'they belong'} to")
        try:
            n = source_info(spec.source_dict())[0]
        except UserError as exc:
            raise data_error(job.path, phase, exc) from None
        if spec.batch_size > n:
            notes.append(f"note: data.{phase}.batch_size {spec.batch_size} is larger than the "
                         f"{n} samples of the {phase} data: each batch holds samples several "
                         "times over")
    return notes


def data_error(path, phase, exc):
    """A UserError of reading the data of ``data.<phase>`` as a ConfigError
    naming the config ``path`` and the spec's key: the one a DataSpecError
    names (split, crop_size, mean, ...), else ``path`` (the file); a
    ConfigError as it is."""
    if isinstance(exc, ConfigError):
        return exc
    key = exc.key if isinstance(exc, DataSpecError) else "path"
    return ConfigError(path, f"data.{phase}.{key}", str(exc))


def _check_transform(key, spec, path, check_files=True):
    """The transform keys of a data spec (``purine_mpi.data.transform``); absent
    keys stay absent. Whether they fit the samples (crop within H x W, one
    mean per channel, a mean image of the samples' shape) is checked when
    the data op reads the file's shape."""
    out = {}
    mean_file = spec.get("mean_file")
    if mean_file is not None:
        if not isinstance(mean_file, str) or not mean_file:
            raise ConfigError(path, f"{key}.mean_file", "expected the path of a Caffe "
                                                        f".binaryproto mean image, got "
                                                        f"{excerpt(mean_file)}")
        if spec.get("mean") is not None:
            raise ConfigError(path, f"{key}.mean_file", "give mean_file or mean, not both (as "
                                                        "Caffe: mean_file or mean_value)")
        out["mean_file"] = _resolve_data_path(mean_file, path, f"{key}.mean_file", check_files,
                                              what="mean file")
        if check_files:  # a damaged file is named against its key, before any graph is built
            from ..base.errors import UserError
            from ..data.protowire import read_mean_file
            try:
                read_mean_file(out["mean_file"])
            except UserError as e:
                raise ConfigError(path, f"{key}.mean_file", str(e)) from None
    if spec.get("scale") is not None:
        out["scale"] = float(_checked(key, "scale", spec["scale"], path))
    mean = spec.get("mean")
    if mean is not None:
        values = mean if isinstance(mean, list) else [mean]
        if not values or not all(_is_number(v) for v in values):
            raise ConfigError(path, f"{key}.mean", "expected a number or a list of numbers (one "
                                                   f"per channel), got {excerpt(mean)}")
        out["mean"] = [float(v) for v in values] if isinstance(mean, list) else float(mean)
    for name in ("mirror", "crop_size"):
        if spec.get(name) is not None:
            out[name] = _checked(key, name, spec[name], path)
    return out


def _same_content(a, b, folder=False):
    """Whether data files (or LMDB folders: their ``data.mdb``) ``a`` and
    ``b`` are one file or hold the same bytes (``inputs.data_file_digest``,
    the start-up agreement's: a bounded read)."""
    if os.path.samefile(a, b):
        return True
    if folder:
        a, b = os.path.join(a, "data.mdb"), os.path.join(b, "data.mdb")
    return data_file_digest(a)[0] == data_file_digest(b)[0] != "not found"


def _resolve_data_path(data_path, config_path, key, check_files, folder=False,
                       what="data file"):
    """The data file relative to the working directory or to the config
    file's directory (so a config works from the repo root and from its own
    folder), the working directory's first where both hold the same bytes;
    a ConfigError where their bytes differ (which one a run read would
    depend on where it started). Returns an
    absolute path when the file was found. ``folder``: a folder counts too
    (an LMDB)."""
    candidates = [data_path]
    if not os.path.isabs(data_path) and config_path and not config_path.startswith("<"):
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(config_path)), data_path))
    found = [c for c in candidates if os.path.isfile(c) or (folder and os.path.isdir(c))]
    if len(found) == 2 and not _same_content(*found, folder=folder):
        # the run would read one or the other by the folder it starts from
        raise ConfigError(config_path, key, f"{excerpt(data_path)} names two "
                                            f"different {'lmdb folder' if folder else what}s: "
                                            f"{excerpt(os.path.abspath(found[0]))} (from the "
                                            "working directory) and "
                                            f"{excerpt(os.path.abspath(found[1]))} (beside the "
                                            "config); give the one to read by an absolute "
                                            "path, or remove the other")
    if found:
        return os.path.abspath(found[0])
    if check_files and not folder and any(os.path.isdir(c) for c in candidates):
        found = next(c for c in candidates if os.path.isdir(c))
        raise ConfigError(config_path, key, f"{what} {excerpt(data_path)} is a folder "
                                            f"({excerpt(os.path.abspath(found))}), not a file; "
                                            "give the file's path")
    odd = [c for c in candidates if os.path.exists(c) and not os.path.isdir(c)]
    if check_files and odd:  # a device, a pipe, a socket: there, but no file to read
        raise ConfigError(config_path, key, f"{what} {excerpt(data_path)} is not a regular "
                                            f"file ({excerpt(os.path.abspath(odd[0]))} is a "
                                            "device, pipe or socket); give the file's path")
    if check_files:
        tried = " or ".join(excerpt(os.path.abspath(c)) for c in candidates)
        hint = data_hint(data_path, what) if what.endswith("data file") and not folder else (
            "make it with Caffe's convert_imageset (or compute_image_mean for a mean file), "
            "or give the right path")
        raise ConfigError(config_path, key, f"{'lmdb source' if folder else what} "
                                            f"{excerpt(data_path)} not found (looked for "
                                            f"{tried}); {hint}")
    return data_path
