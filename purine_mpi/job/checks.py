"""Checks of single config values, each naming the file, the dotted key and
what was expected (``ConfigError``), and the builders of the sections'
checker tables (``_int(1)``, ``_num(0, strict=True)``, ``_choice(...)``),
whose ``doc`` is the type column of docs/config.md. Imports ``errors``.
"""
import difflib
import math
import os

from ..base.errors import ConfigError, excerpt


SEED_LIMIT = 2 ** 63  # seeds are stored as 64-bit integers (checkpoints, HDF5)


def _described(doc):
    """Attach ``doc`` (the type column of docs/config.md) to a checker."""
    def deco(check):
        check.doc = doc
        return check
    return deco


@_described("list of integers")
def _stepvalues(key, value, path):
    if (not isinstance(value, list) or not all(_is_int(v) and v > 0 for v in value)
            or any(b <= a for a, b in zip(value, value[1:]))):
        raise ConfigError(path, key, f"expected an increasing list of positive integers "
                                     f"(iterations), got {excerpt(value)}")
    return [int(v) for v in value]


def _optional(check):
    return _described(f"{check.doc} or null")(
        lambda key, value, path: None if value is None else check(key, value, path))


def _int(minimum):
    doc = {0: "integer >= 0", 1: "integer > 0"}.get(minimum, f"integer >= {minimum}")
    return _described(doc)(lambda key, value, path: _check_int(key, value, path,
                                                                minimum=minimum))


def _number_range(minimum, strict, below, doc):
    """The allowed range of a number key, in the reference's terse words
    (``doc``) or in an error message's."""
    if minimum == 0 and below is not None:
        return f"number in [0, {below})" if doc else f"a number in [0, {below})"
    if minimum == 0:
        if doc:
            return "number > 0" if strict else "number >= 0"
        return "a positive number" if strict else "a non-negative number"
    return "number" if doc else "a number"


def _num(minimum=None, strict=False, below=None):
    return _described(_number_range(minimum, strict, below, doc=True))(
        lambda key, value, path: _check_number(key, value, path, minimum, strict, below))


def _choice(choices):
    return _described(f"one of {', '.join(choices)}")(
        lambda key, value, path: _check_choice(key, value, choices, path))


@_described("true/false")
def _bool(key, value, path):
    return _check_bool(key, value, path)


# ------------------------------------------------------------ scalar checks
def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _number_text_why(value):
    """Why a plain number-like text is text here: ``08`` (YAML 1.1, which
    this reader follows, reads a leading 0 as octal, where 8 and 9 are no
    digits) and ``0o24`` (YAML 1.2's octal, text in 1.1); "" otherwise."""
    if not isinstance(value, str):
        return ""
    text = value.strip().replace("_", "")
    sign = "-" if text.startswith("-") else ""
    digits = text.lstrip("+-")
    if len(digits) > 1 and digits.isdigit() and digits[0] == "0" and (
            "8" in digits or "9" in digits):
        return (f" (a leading 0 makes an octal number in YAML 1.1, the version this reader "
                f"follows, and 8 and 9 are no octal digits, so {value} reads as text: write "
                f"{sign}{int(digits, 10)})")
    if len(digits) > 2 and digits[:2] in ("0o", "0O") and all(c in "01234567"
                                                               for c in digits[2:]):
        return (f" ({value} is the octal number {sign}{int(digits[2:], 8)} in YAML 1.2 but "
                f"text in YAML 1.1, the version this reader follows: write "
                f"{sign}{int(digits[2:], 8)})")
    return ""


def check_seed(key, value, path):
    """A seed: an integer in [0, 2^63) (``seed``, ``data.*.seed``, ``--seed``)."""
    if _is_int(value) and 0 <= value < SEED_LIMIT:
        return int(value)
    raise ConfigError(path, key, f"expected a non-negative integer below 2^63 (it is stored "
                                 f"as a 64-bit integer), got {excerpt(value)}"
                                 f"{_number_text_why(value)}")


def _check_int(key, value, path, minimum=None):
    ok = _is_int(value) or (isinstance(value, float) and value.is_integer())
    # below 2^63: counts and sizes are 64-bit integers in arrays, files and shapes
    if ok and (minimum is None or value >= minimum) and abs(value) < SEED_LIMIT:
        return int(value)
    want = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}")
    limit = " below 2^63" if ok and abs(value) >= SEED_LIMIT else ""
    raise ConfigError(path, key, f"expected {want}{limit}, got {excerpt(value)}"
                                 f"{_number_text_why(value)}")


def _check_number(key, value, path, minimum=None, strict=False, below=None):
    number = value
    if isinstance(value, str):  # 1e-3 reads as a number (_Loader): this was quoted
        why = _number_text_why(value) or " (a number is written without quotes)"
        raise ConfigError(path, key, f"expected {_number_range(minimum, strict, below, False)}"
                                     f", got the string {excerpt(value)}{why}")
    if isinstance(number, bool) or not isinstance(number, (int, float)) \
            or not math.isfinite(number):  # .nan and .inf are YAML numbers, never good ones
        number = None
    ok = number is not None
    if ok and minimum is not None:
        ok = number > minimum if strict else number >= minimum
    if ok and below is not None:
        ok = number < below
    if ok:
        return number
    want = _number_range(minimum, strict, below, doc=False)
    raise ConfigError(path, key, f"expected {want} (finite), got {excerpt(value)}")


def _check_bool(key, value, path):
    if isinstance(value, bool):
        return value
    raise ConfigError(path, key, f"expected true or false, got {excerpt(value)}")


def _check_choice(key, value, choices, path):
    if value in choices:
        return value
    hint = _suggest(value, choices)
    raise ConfigError(path, key, f"expected one of {', '.join(choices)}, "
                                 f"got {excerpt(value)}{hint}")


def _check_keys(section, mapping, allowed, path):
    for k in mapping:
        if k not in allowed:
            key = f"{section}.{k}" if section else str(k)
            where = f"in '{section}'" if section else "at the top level"
            if not section and str(k).startswith("_"):
                raise ConfigError(path, key, f"unknown key {excerpt(k)} at the top level (keys "
                                  "starting with '_' are not private: they are rejected like "
                                  "any unknown key; to share a value, put a YAML anchor &name "
                                  f"on its first use) (valid keys: {', '.join(allowed)})")
            raise ConfigError(path, key, f"unknown key {excerpt(k)} {where}{_suggest(k, allowed)} "
                                         f"(valid keys: {', '.join(allowed)})")


#: other frameworks' names of our keys (PyTorch, Hugging Face, nanoGPT, Keras),
#: offered where difflib finds nothing alike: 'learning_rate' is not close
#: to 'base_lr' as strings. An entry counts only where its key is allowed.
COMMON_NAMES = {"learning_rate": "base_lr", "lr": "base_lr", "max_steps": "max_iter",
                "max_iters": "max_iter", "epochs": "max_iter", "num_epochs": "max_iter",
                "iterations": "max_iter", "batch": "batch_size", "bs": "batch_size",
                "optimizer": "type", "eps": "delta", "epsilon": "delta",
                "beta1": "momentum", "beta2": "momentum2", "warmup_steps": "warmup_iters",
                "warmup": "warmup_iters", "grad_clip": "clip_gradients",
                "gradient_clip_val": "clip_gradients", "max_grad_norm": "clip_gradients",
                "lr_scheduler": "lr_policy", "scheduler": "lr_policy",
                "eval_interval": "test_interval", "eval_iters": "test_iter",
                "log_interval": "display", "save_interval": "interval"}


def _suggest(value, choices):
    choices = [str(c) for c in choices]
    alias = COMMON_NAMES.get(str(value).lower())
    if alias in choices:
        return f" (did you mean {alias!r}?)"
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(value):
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {excerpt(value)}"


# ------------------------------------------------------ checks of one key
@_described("string")
def _check_name(key, name, path):
    if not isinstance(name, str) or not name.strip() or "/" in name or name in (".", ".."):
        raise ConfigError(path, "name", "expected a non-empty name without '/' (it names the "
                                        f"output directory runs/<name>), got {excerpt(name)}")
    return name


@_described("mapping layer → stage, or integer > 0")
def _check_stages(key, value, path):
    """parallel.stages: {layer name: stage} for scheme pipeline or hybrid,
    or the number of stages (config.py resolves it into the map)."""
    if _is_int(value):
        if value < 1:
            raise ConfigError(path, key, f"expected a number of stages >= 1 (or a mapping of "
                                         f"layer name to stage), got {excerpt(value)}")
        return value
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and _is_int(v) and v >= 0 for k, v in value.items()):
        raise ConfigError(path, key, f"expected a mapping of layer name to stage, e.g. "
                                     f"{{conv1: 0, fc1: 1}}, got {excerpt(value)}")
    return value


@_described("list of strings or null")
def _check_patterns(key, value, path):
    """recompute_layers: layer name patterns (the net's rule checks that each matches)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or \
            not all(isinstance(v, str) and v for v in value):
        raise ConfigError(path, key, f"expected a list of layer name patterns, e.g. "
                                     f"['h*_attn'], got {excerpt(value)}")
    return list(value)


@_described("string or null")
def _check_folder(key, value, path):
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(path, key, f"expected a folder path or null, got {excerpt(value)}")
    if value is not None and os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(path, key, f"expected a folder path or null, got {excerpt(value)}, "
                                     "which is a file")
    return value


@_described("bytes, or a size such as 256MiB")
def _size(key, value, path):
    """A positive byte count: an integer, or a string ``parse_size`` reads."""
    from ..base.progress_bar import parse_size
    nbytes = value if _is_int(value) and value > 0 else \
        (parse_size(value) if isinstance(value, str) else None)
    if nbytes is None:
        raise ConfigError(path, key, f"expected a positive byte count or a size such as 256MiB "
                                     f"(KiB/MiB/GiB or K/M/G: powers of 1024; KB/MB/GB: of "
                                     f"1000), got {excerpt(value)}")
    return nbytes
