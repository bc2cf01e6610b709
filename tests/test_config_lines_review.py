"""Review of the config-line change (job/yamlread.read_yaml_lines,
job/config.key_line) and of the folder rule the CIFAR-10 download shares
with the run folders (base/runfiles.missing_folders): the line of a key
under an anchor that an alias repeats later, of a key written through an
alias's later use, of a key that is not a string (``yes:``) or holds a dot,
after a quoted string holding U+2028; a failed download into ``a/b/../c``
leaves no folder."""
import os
import textwrap

import pytest

from purine_mpi.base.errors import ConfigError, UserError
from purine_mpi.job.config import key_line, load_job
from purine_mpi.job.yamlread import read_yaml, read_yaml_lines

HEAD = """\
name: x
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, batch_size: 4}
"""
TAIL = """\
net:
  - {type: fc, name: fc, bottom: data, top: fc, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}
solver:
  base_lr: 0.1
  max_iter: 3
"""


def _refusal(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_job(str(path), check_files=False)
    return str(e.value).replace(str(path), name)


def test_a_key_under_an_anchor_an_alias_repeats_names_its_own_line(tmp_path):
    """The table was walked last key first, so an alias's later use took
    the anchor's value and the anchor's own keys fell back to the line of
    their parent."""
    text = HEAD.replace("  train: {source: synthetic, shape: [1, 8, 8], classes: 10, "
                        "batch_size: 4}\n",
                        "  train: &t\n"
                        "    source: synthetic\n"
                        "    shape: [1, 8, 8]\n"
                        "    classes: 10\n"
                        "    batch_size: 0\n"
                        "  test: *t\n") + TAIL
    # before: job.yaml:3 (the line of 'train: &t')
    assert _refusal(tmp_path, text).startswith("job.yaml:7: key 'data.train.batch_size': ")
    text = HEAD + textwrap.dedent("""\
        net:
          - type: fc
            name: fc
            bottom: data
            top: fc
            num_output: 10
            weight_filler: &f
              type: gaussian
              std: -1
          - {type: fc, name: fc2, bottom: fc, top: fc2, num_output: 10, weight_filler: *f}
          - {type: softmax_loss, name: loss, bottom: [fc2, label], top: loss}
        solver: {base_lr: 0.1, max_iter: 3}
        """)
    # before: job.yaml:10 (the line of 'weight_filler: &f')
    assert _refusal(tmp_path, text).startswith("job.yaml:12: key 'net[0].weight_filler.std': ")


def test_a_key_through_an_alias_names_the_line_of_its_text():
    text = "a: &x\n  b:\n    c: 1\nd: *x\ne:\n  <<: *x\n"
    data, lines = read_yaml_lines(text, "t.yaml")
    assert data == read_yaml(text, "t.yaml")
    assert key_line("a.b.c", lines) == 3
    # before: 4 ('d: *x'), 2 (the merged 'b:', its c not followed)
    assert key_line("d.b.c", lines) == 3 and key_line("d.b", lines) == 2
    assert key_line("e.b.c", lines) == 3
    assert key_line("d.b.nope", lines) == 2 and key_line("d", lines) == 4


def test_keys_that_are_not_plain_names_name_their_line(tmp_path):
    solver_extra = TAIL + "  yes: 1\n"  # line 10: an error names it 'solver.True'
    # before: job.yaml:7, the line of 'solver:'
    assert _refusal(tmp_path, HEAD + solver_extra).startswith("job.yaml:10: key 'solver.True': ")
    assert _refusal(tmp_path, HEAD + TAIL + "  ~: 1\n").startswith(
        "job.yaml:10: key 'solver.None': ")
    assert _refusal(tmp_path, HEAD + TAIL + "  a.b: 1\n").startswith(
        "job.yaml:10: key 'solver.a.b': ")


def test_a_line_separator_in_a_quoted_string_does_not_shift_the_lines(tmp_path):
    """PyYAML counts NEL, U+2028 and U+2029 as line breaks; an editor, grep
    and sed do not."""
    text = HEAD.replace("name: x", 'name: "x\u2028y\x85z"') + TAIL.replace("base_lr: 0.1",
                                                                           "base_lr: -1")
    # before: job.yaml:10
    assert _refusal(tmp_path, text).startswith("job.yaml:8: key 'solver.base_lr': ")
    assert _refusal(tmp_path, text.replace("\n", "\r\n"), "crlf.yaml").startswith(
        "crlf.yaml:8: key 'solver.base_lr': ")


def test_a_failed_download_into_a_dotdot_cache_leaves_no_folder(tmp_path, monkeypatch):
    """``--download --from a/b/../c``: the download made a and a/c (the
    real path), the cleanup removed a/c, then stopped at a/b, which
    missing_folders names and nothing made: a stayed, empty."""
    from purine_mpi.data.download import download_cifar10
    monkeypatch.setenv("PURINE_CIFAR10_URL", (tmp_path / "none.tar.gz").as_uri())
    cache = os.path.join(str(tmp_path), "a", "b", "..", "c")
    with pytest.raises(UserError, match="could not download"):
        download_cifar10(cache)
    # before: ['a']
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


def test_a_malformed_set_names_the_set_not_a_line_of_the_file(tmp_path):
    """load_job (the API the converters and tools use) put the file and the
    line of 'net:' on a --set that cannot be applied; the CLI's
    blame_override hid it. Now both name the --set."""
    path = tmp_path / "job.yaml"
    path.write_text(HEAD + TAIL)
    for text, start in [("net.x.name=a", "--set net.x.name=a: key 'net.x.name': bad --set "),
                        ("solver.base_lr", "--set solver.base_lr: bad --set override"),
                        ("name.sub=1", "--set name.sub=1: key 'name.sub': bad --set ")]:
        with pytest.raises(ConfigError) as e:
            load_job(str(path), [text], check_files=False)
        # before: f"{path}:4: key 'net.x.name': bad --set ..." (and f"{path}: bad --set ...")
        assert str(e.value).startswith(start), str(e.value)
        assert e.value.line is None


GRAPH_JOB = HEAD + """\
net:
  - {type: conv, name: conv1, bottom: data, top: conv1, num_output: 4, kernel: 3}
  - type: conv
    name: conv2
    bottom: conv1
    top: conv2
    num_output: 4
    kernel: 30
  - {type: fc, name: fc, bottom: conv2, top: fc, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc, label], top: loss}
solver: {base_lr: 0.1, max_iter: 3}
"""


def test_an_error_found_later_is_placed_in_the_text_the_job_was_loaded_from(tmp_path):
    """blame_override read the file again: one edited since the job was
    loaded gave the line of its new text, and a pipe (``<(...)``,
    ``/dev/stdin``), empty on a second read, gave no line and lost the
    ``--set`` that wrote the key."""
    import subprocess
    import sys
    from purine_mpi.job.config import blame_override
    from tests.conftest import REPO, cli_env
    path = tmp_path / "job.yaml"
    path.write_text(GRAPH_JOB)
    load_job(str(path), check_files=False)  # kernel 30 does not fit: found building the graph
    path.write_text("# edited\n\n\n" + GRAPH_JOB)
    late = ConfigError(str(path), "net[1].kernel", "does not fit")
    # before: 14, the line in the edited file
    assert blame_override(late, str(path), ()).line == 11
    for args, start in [((), "error: /dev/stdin:11: key 'net[1].kernel': "),
                        (("--set", "net.1.kernel=40"),
                         "error: --set net.1.kernel=40: key 'net[1].kernel': ")]:
        res = subprocess.run([sys.executable, "-m", "purine_mpi", "graph", "/dev/stdin", *args],
                             input=GRAPH_JOB, cwd=REPO, env=cli_env(), capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 2, res.stderr
        # before: "error: /dev/stdin: key 'net[1].kernel': ..." both times
        assert res.stderr.startswith(start), res.stderr


def test_a_key_with_a_line_break_or_an_escape_is_printed_on_one_line(tmp_path):
    """The message's ``key '...'`` printed a YAML key as it is: ``"a\\nb\\e[31m": 1``
    split the one-line error in two and sent the escape to the terminal."""
    from tests.conftest import run_cli_here
    path = tmp_path / "job.yaml"
    path.write_text(HEAD + TAIL + '  "a\\nb\\e[31m": 1\n')
    res = run_cli_here("graph", str(path))
    assert res.returncode == 2, res.stderr
    # before: "error: ...job.yaml:10: key 'solver.a" then "b\x1b[31m': unknown key ..."
    assert res.stderr.count("\n") == 1 and "\x1b" not in res.stderr, repr(res.stderr)
    assert res.stderr.startswith(f"error: {path}:10: key 'solver.a\\nb\\x1b[31m': unknown key "), \
        repr(res.stderr)


@pytest.mark.parametrize("where", ["net", "graph"])
def test_a_thread_name_refuses_control_characters(where):
    """``graph`` prints each op's thread beside it (``(rank 0, thread NAME)``):
    a layer's or a ``graph:`` op's thread name with ESC or a line break
    acted on the terminal as the names the change covered did."""
    from purine_mpi.job.config import resolve_config
    if where == "net":
        config = {"data": {"train": {"source": "synthetic", "shape": [1, 8, 8], "classes": 10,
                                     "batch_size": 4}},
                  "net": [{"type": "fc", "name": "fc", "bottom": "data", "top": "fc",
                           "num_output": 10, "thread": "t\x1b[31m"},
                          {"type": "softmax_loss", "name": "loss", "bottom": ["fc", "label"],
                           "top": "loss"}],
                  "solver": {"base_lr": 0.1, "max_iter": 1}}
        key = "net.0.thread"
    else:
        config = {"graph": [{"type": "blob", "name": "a", "size": [2]},
                            {"type": "blob", "name": "b", "size": [2],
                             "attrs": {"loss_weight": 1.0}},
                            {"type": "op", "name": "relu", "op_type": "Relu", "inputs": ["a"],
                             "outputs": ["b"], "thread": "t\nx"}],
                  "solver": {"base_lr": 0.1, "max_iter": 1}}
        key = "graph.2.thread"
    # before: accepted, and `graph` printed "(rank 0, thread t\x1b[31m)"
    with pytest.raises(ConfigError, match="control character") as e:
        resolve_config(config, "t.yaml")
    assert e.value.key == key
    config[where][0 if where == "net" else 2]["thread"] = "io2"
    resolve_config(config, "t.yaml")  # a printable name stays accepted


def test_the_yaml_refusals_count_lines_as_an_editor_does():
    """The duplicate-key refusal and a malformed-YAML error after a quoted
    U+2028 named the next line (PyYAML counts it as a line break)."""
    from purine_mpi.job.config import _parse_text
    with pytest.raises(ConfigError) as e:
        _parse_text('a: "x\u2028y"\nb: 1\nb: 2\n', "f.yaml")
    # before: "at f.yaml:3 and at f.yaml:4"
    assert "at f.yaml:2 and at f.yaml:3" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        _parse_text('a: "x\u2028y"\nb: [1,\n', "f.yaml")
    # before: "line 4, column 1"
    assert "malformed YAML at line 3, column 1: " in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:  # a comment: PyYAML ends it at the NEL
        _parse_text("a: 1 # c\x85d\nb: 2\n", "f.yaml")
    # before: "(started at line 2, column 1)"
    assert "(started at line 1, column 10)" in str(e.value), str(e.value)


def test_an_output_file_through_dotdot_is_written_where_the_system_puts_it(tmp_path):
    """``--out a/b/../c/t.h5`` (``data``, ``predict``, ``export onnx``): its
    folder was made from its abspath, ``a/c``, but the file opened as
    written needs ``a/b`` too: refused ("No such file or directory") with
    ``a/c`` left; ``link/../x/t.h5`` made ``x`` beside the link, not beside
    its target where the file goes. check_writable (predict's up-front
    check of --out) refused both alike."""
    from purine_mpi.base.runfiles import check_writable
    from tests.conftest import run_cli_here
    (tmp_path / "real" / "t").mkdir(parents=True)
    os.symlink(tmp_path / "real" / "t", tmp_path / "link")
    for out in ("a/b/../c/p.h5", "link/../x/p.h5"):
        # before: UserError "...: cannot be written there (No such file or directory)"
        check_writable(os.path.join(str(tmp_path), out))
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]  # nothing left by the check
    assert os.listdir(tmp_path / "real") == ["t"]
    (tmp_path / "t.txt").write_text("some text to read as bytes. " * 50)
    res = run_cli_here("data", "text", "--from", str(tmp_path / "t.txt"), "--out",
                       os.path.join(str(tmp_path), "a", "b", "..", "c", "t.h5"))
    # before: exit 2, "cannot be written there (No such file or directory)", a/c left
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "a" / "c" / "t.h5").is_file() and (tmp_path / "a" / "b").is_dir()
    res = run_cli_here("data", "text", "--from", str(tmp_path / "t.txt"), "--out",
                       os.path.join(str(tmp_path), "link", "..", "x", "t.h5"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "real" / "x" / "t.h5").is_file() and not (tmp_path / "x").exists()
