"""Review of the inspect / h5links rewrite (session 67): a text data file
reading its tokens from another file is refused like any other HDF5 input;
``inspect --diff`` compares a name one file reaches through a second name
of a group instead of calling it "only in" the other; a checkpoint whose
group links to its own parent is refused in one short line; a data file's
link text is shown escaped. Each test failed on a59cc75 (the assertion
named in its docstring)."""
import json

import h5py
import numpy as np
import pytest

from purine_mpi.base.errors import UserError


def _text_file(path, tokens):
    with h5py.File(path, "w") as f:
        f["train/tokens"] = tokens
        f["val/tokens"] = tokens[:64]


def test_text_tokens_read_from_another_file_are_refused(tmp_path):
    """A text data file whose /train/tokens is an external link, external
    storage (any file's bytes, read as tokens) or a virtual dataset whose
    source is missing (read as zeros): text_info and TextSource refuse it
    naming the dataset and what it reads. Before: ``pytest.raises(UserError)``
    failed (DID NOT RAISE: the run trained on the other file's bytes, or on
    zeros)."""
    from purine_mpi.data.text import TextSource, text_info
    tokens = np.arange(4096, dtype=np.uint8)
    good = tmp_path / "good.h5"
    _text_file(good, tokens)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(tokens.tobytes())
    cases = {}

    def variant(name, make, *words):
        path = tmp_path / f"{name}.h5"
        _text_file(path, tokens)
        with h5py.File(path, "a") as f:
            del f["train/tokens"]
            make(f)
        cases[path] = words

    variant("extlink", lambda f: f.__setitem__("train/tokens", h5py.ExternalLink(
        str(good), "/train/tokens")), "an external link", str(good))
    variant("storage", lambda f: f.create_dataset(
        "train/tokens", shape=tokens.shape, dtype=tokens.dtype,
        external=[(str(secret), 0, tokens.nbytes)]), "stored in external file", str(secret))

    def vds(f):
        layout = h5py.VirtualLayout(shape=tokens.shape, dtype=tokens.dtype)
        layout[...] = h5py.VirtualSource(str(tmp_path / "gone.h5"), "/t", shape=tokens.shape)
        f.create_virtual_dataset("train/tokens", layout)
    variant("vds", vds, "virtual dataset", "gone.h5")
    with h5py.File(tmp_path / "group.h5", "w") as f:  # the split's group itself elsewhere
        f["train"] = h5py.ExternalLink(str(good), "/train")
    cases[tmp_path / "group.h5"] = ("'/train' is an external link",)
    with h5py.File(tmp_path / "soft.h5", "w") as f:  # a soft link through an external one
        f["e"] = h5py.ExternalLink(str(good), "/")
        f["train/tokens"] = h5py.SoftLink("/e/train/tokens")
    cases[tmp_path / "soft.h5"] = ("'/train/tokens' is a soft link", "external link")
    spec = {"source": "text", "split": "train", "batch_size": 2, "sequence_length": 8}
    assert text_info(dict(spec, path=str(good)))[0] > 0
    assert len(TextSource(dict(spec, path=str(good))).tokens) == tokens.size
    for path, words in cases.items():
        for read in (text_info, TextSource):
            with pytest.raises(UserError) as e:
                read(dict(spec, path=str(path)))
            for word in ("'/train", str(path), *words):
                assert word in str(e.value), (word, str(e.value))


def _diff(a, b):
    from purine_mpi.tools.inspect import inspect_checkpoint
    return json.loads(inspect_checkpoint(a, diff=b, as_json=True))["diff"]


def test_diff_reaches_names_through_a_second_group_name(tmp_path):
    """/h a second hard link to the group /g, or a soft link to it: /h/x is
    the dataset /g/x, which --diff against a file holding /g/x and /h/x as
    two copies compares (equal), either way round; one that differs is
    found. Before: ``only_in_second == []`` failed (['/h/x']: the walk
    lists each group's contents under one name only)."""
    v = np.arange(6, dtype=np.float32)
    copy, hard, soft, other = (tmp_path / f"{n}.h5" for n in ("copy", "hard", "soft", "other"))
    with h5py.File(copy, "w") as f:
        f["g/x"] = v
        f["h/x"] = v
    with h5py.File(hard, "w") as f:
        f["g/x"] = v
        f["h"] = f["g"]
    with h5py.File(soft, "w") as f:
        f["g/x"] = v
        f["h"] = h5py.SoftLink("/g")
    with h5py.File(other, "w") as f:
        f["g/x"] = v
        f["h/x"] = v + 1
    for a, b in ((hard, copy), (copy, hard), (soft, copy), (copy, soft)):
        diff = _diff(a, b)
        assert diff["only_in_first"] == [] and diff["only_in_second"] == [], (a, b, diff)
        rows = {r["name"]: r for r in diff["datasets"]}
        assert set(rows) == {"/g/x", "/h/x"}
        assert rows["/h/x"]["max_abs_diff"] == 0.0
    rows = {r["name"]: r for r in _diff(hard, other)["datasets"]}
    assert rows["/h/x"]["max_abs_diff"] == 1.0 and rows["/g/x"]["max_abs_diff"] == 0.0
    with h5py.File(tmp_path / "more.h5", "w") as f:  # a name neither reaches stays "only in"
        f["g/x"] = v
        f["h/x"] = v
        f["h/y"] = v
    assert _diff(hard, tmp_path / "more.h5")["only_in_second"] == ["/h/y"]


def test_a_group_that_is_its_own_parent_is_refused_in_one_line(tmp_path):
    """/params/fc1/up, a hard link to /params (a cycle): loading the
    weights exits with one short line naming the name and the cycle.
    Before: ``"cycle" in message`` failed (RecursionError, its message
    a path of thousands of characters: params/fc1/up/fc1/up/...)."""
    from purine_mpi.job.checkpoint_file import load_params
    path = tmp_path / "loop.h5"
    with h5py.File(path, "w") as f:
        f["params/fc1/weight"] = np.ones((2, 2), np.float32)
        f["params/fc1/up"] = f["params"]
    with pytest.raises(UserError) as e:
        load_params(str(path))
    message = str(e.value)
    assert "cycle" in message, message[:300]
    assert "'/params/fc1/up'" in message and len(message) < 400, message[:300]


def test_a_data_file_link_is_named_with_escapes(tmp_path):
    """A data file's /data, an external link whose file and path hold ESC
    and a newline: the refusal shows them escaped, on one line. Before:
    ``"\\x1b" not in message`` failed (the raw ESC in the message)."""
    from purine_mpi.data.sources import hdf5_info
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["data"] = h5py.ExternalLink("f\x1b[2J.h5", "/d\nx")
        f["label"] = np.zeros(4, np.int64)
    with pytest.raises(UserError) as e:
        hdf5_info(str(path))
    message = str(e.value)
    assert "\x1b" not in message and "\n" not in message, message
    assert "'f\\x1b[2J.h5'" in message and "'/d\\nx'" in message, message


def test_layer_names_with_control_characters_are_refused(tmp_path):
    """A layer name (or top, bottom) holding ESC, a newline or a
    bidirectional override, which graph and the logs print as they are:
    refused naming the key, the value shown escaped. Before:
    ``pytest.raises(ConfigError)`` failed (DID NOT RAISE: graph printed
    the raw ESC)."""
    import yaml
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.config import load_config
    from tests.conftest import small_net_config, write_config_file
    base = small_net_config(str(tmp_path / "d.h5"))
    ok = write_config_file(tmp_path, base, "ok.yaml")
    load_config(ok, check_files=False)  # printable, non-ASCII names are fine
    for field, j, bad in (("name", 3, "fc1\x1b[31m"), ("top", 3, "fc1\nx"),
                          ("name", 0, "conv\u202e1")):
        cfg = yaml.safe_load(yaml.safe_dump(base))
        cfg["net"][j][field] = bad
        path = write_config_file(tmp_path, cfg, "bad.yaml")
        with pytest.raises(ConfigError) as e:
            load_config(path, check_files=False)
        assert f"net.{j}.{field}" in str(e.value) and "control character" in str(e.value)
        assert "\x1b" not in str(e.value) and "\n" not in str(e.value)
    cfg = yaml.safe_load(yaml.safe_dump(base))
    cfg["net"][3]["name"] = "fc1 \u00e9"
    load_config(write_config_file(tmp_path, cfg, "uni.yaml"), check_files=False)


def test_the_note_on_unused_blobs_shows_names_escaped():
    """A weights file's /params name holding ESC and a bidi override, which
    test, train --init and predict name in a note on blobs the net does not
    use: shown escaped. Before: ``"\\x1b" not in note`` failed (the file's
    ESC sequence reached the terminal)."""
    from purine_mpi.job.checkpoint_check import unused_note
    note = unused_note({"fc1/weight": 0, "ev\x1b[31mil\u202e/weight": 0}, ["fc1/weight"], "w.h5")
    assert "\x1b" not in note and "\u202e" not in note, note
    assert note.endswith("ev\\x1b[31mil\\u202e/weight"), note
