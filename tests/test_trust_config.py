"""Issue 32 "Trust", the config-parsing and environment cases: every YAML the
program reads is strict and bounded (job/yamlread.py), values in messages are
short excerpts (errors.excerpt), and every PURINE_* variable is checked like
a config key (base/env.py). Each case test exits 2 with a one-line message naming
the file and line (or the variable), no traceback; on 6dff0b5 each failed
(noted per test)."""
import os
import re
import resource
import subprocess
import time

import pytest
import yaml

from tests.conftest import PYTHON, REPO, cli_env, run_cli_here, small_net_config

TINY = "{base_lr: 0.05, lr_policy: fixed, max_iter: 2, test_interval: 0}"


def _job(digits_h5, **overrides):
    return yaml.safe_dump(small_net_config(digits_h5, **overrides), sort_keys=False)


def _user_error(res, *needles, limit=1000):
    """Exit 2, one short paragraph naming ``needles``, no traceback."""
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(res.stderr) < limit, (len(res.stderr), res.stderr[:2000])
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)
    return res.stderr


def _limited(*args, timeout=20, memory=2 << 30, extra_env=None):
    """``python -m purine_mpi ARGS`` with an address-space limit and a
    timeout, so a run that would eat the machine fails fast instead."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    return subprocess.run([PYTHON, "-m", "purine_mpi", *map(str, args)], cwd=REPO,
                          env=dict(cli_env(), **(extra_env or {})), capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limit)


# ------------------------------------------------------------------ case 7
def test_case7_duplicate_top_level_key_names_both_lines(run_cli, write_config, digits_h5):
    """Case 7: a second ``solver:`` block at the end silently replaced the
    first (6dff0b5: exit 0, trained with the second's values)."""
    text = _job(digits_h5) + f"solver: {TINY}\n"
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines, 1) if line.startswith("solver:"))
    path = write_config(text, "dup.yaml")
    err = _user_error(run_cli("train", path, "--iters", "0", "--out", os.path.dirname(path)
                              + "/run"), "key 'solver' is given twice",
                      f"dup.yaml:{first}", f"dup.yaml:{len(lines)}")
    assert err.count("\n") == 1


def test_case7_duplicate_nested_key_names_both_lines_and_the_path(write_config, digits_h5):
    """Case 7, nested: a key twice inside one layer of the net (6dff0b5: the
    second won, exit 0)."""
    text = _job(digits_h5).replace("num_output: 4\n", "num_output: 4\n  num_output: 8\n", 1)
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines, 1) if "num_output: 4" in line)
    path = write_config(text, "dupnest.yaml")
    _user_error(run_cli_here("graph", path), "key 'net.0.num_output' is given twice",
                f"dupnest.yaml:{first}", f"dupnest.yaml:{first + 1}")
    # the same in a --set value
    _user_error(run_cli_here("graph", write_config(_job(digits_h5), "ok.yaml"), "--set",
                        "solver={base_lr: 0.1, base_lr: 0.2}"), "--set", "'base_lr' is given twice")


# ------------------------------------------------ YAML 1.1 number forms
@pytest.mark.parametrize("written,yaml11,yaml12",
                         [("1:20", "80", "'1:20'"), ("024", "20", "24"),
                          # binary: before, max_iter 0b101 trained 5 iterations, exit 0
                          ("0b101", "5", "'0b101'")])
def test_yaml11_only_numbers_are_refused_naming_key_and_line(write_config, digits_h5,
                                                             written, yaml11, yaml12):
    """``max_iter: 1:20`` trained 80 iterations and ``max_iter: 024`` 20
    (PyYAML reads YAML 1.1's base-60 and leading-zero octal numbers; YAML
    1.2 and docs/config.md's '1e-3 reads as a number, as in YAML 1.2' read
    the text '1:20' and 24): exit 0 with a value nobody wrote (before the
    fix: ``assert res.returncode == 2`` failed, 0)."""
    text = _job(digits_h5).replace("max_iter: 20", f"max_iter: {written}")
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "max_iter:" in t)
    path = write_config(text, "y11.yaml")
    _user_error(run_cli_here("graph", path), "key 'solver.max_iter'", f"y11.yaml:{line}",
                f"YAML 1.1 ({yaml11})", yaml12)
    # the same in a --set value
    ok = write_config(_job(digits_h5), "ok.yaml")
    _user_error(run_cli_here("graph", ok, "--set", f"solver.max_iter={written}"),
                "--set", "solver.max_iter", f"YAML 1.1 ({yaml11})")


def test_yaml_numbers_both_versions_agree_on_still_load(write_config, digits_h5):
    """Quoted, the forms are text (a layer name); 0, 00, 0x14, 1_000 and 1e3
    read the same in YAML 1.1 and 1.2 and stay numbers; a config dumped with
    such text reloads (the dumper quotes it)."""
    from purine_mpi.job.config import dump_config, load_config
    from purine_mpi.job.yamlread import read_yaml
    assert read_yaml("[0, 00, 0x14, 1_000, 1e3, '024', '1:20', a1:20, '0b101']") == \
        [0, 0, 20, 1000, 1000.0, "024", "1:20", "a1:20", "0b101"]
    cfg = small_net_config(digits_h5)
    cfg["net"][0]["name"] = "024"
    cfg["net"][1]["name"] = "1:20"
    cfg["net"][2]["name"] = "0b101"
    path = write_config(yaml.safe_dump(cfg, sort_keys=False), "quoted.yaml")
    config = load_config(path)
    assert read_yaml(dump_config(config))["net"][0]["name"] == "024"
    assert read_yaml(dump_config(config))["net"][2]["name"] == "0b101"


def test_leading_zero_numbers_both_versions_read_alike_still_load(write_config, digits_h5):
    """``01`` to ``07`` (and ``-05``, ``0_7``) are the same number in YAML 1.1
    (octal) and 1.2 (decimal): they were refused with "octal in YAML 1.1 (7)
    and decimal in YAML 1.2 (7)" (before the fix: ``read_yaml`` raised
    YamlRefused); ``010`` (8 or 10) is still refused."""
    from purine_mpi.job.config import load_config
    from purine_mpi.job.yamlread import YamlRefused, read_yaml
    assert read_yaml("[07, -05, 0_7, +01, 00]") == [7, -5, 7, 1, 0]
    path = write_config(_job(digits_h5).replace("max_iter: 20", "max_iter: 07"), "l0.yaml")
    assert load_config(path)["solver"]["max_iter"] == 7
    with pytest.raises(YamlRefused, match=r"octal in YAML 1.1 \(8\) and decimal in YAML 1.2 "
                                          r"\(10\)"):
        read_yaml("a: 010")


@pytest.mark.parametrize("written,why", [
    ("08", "a leading 0 makes an octal number in YAML 1.1, the version this reader follows, "
           "and 8 and 9 are no octal digits, so 08 reads as text: write 8"),
    ("0o24", "0o24 is the octal number 20 in YAML 1.2 but text in YAML 1.1, the version this "
             "reader follows: write 20")])
def test_number_text_of_the_other_yaml_version_says_why(write_config, digits_h5, written, why):
    """``max_iter: 08`` and ``max_iter: 0o24`` are text to YAML 1.1 (PyYAML)
    and numbers (8, 20) to YAML 1.2: they were refused with "expected a
    non-negative integer, got '08'" alone, which reads as nonsense (before
    the fix: the assertion on ``why`` in the message failed)."""
    text = _job(digits_h5).replace("max_iter: 20", f"max_iter: {written}")
    path = write_config(text, "y12.yaml")
    _user_error(run_cli_here("graph", path), "key 'solver.max_iter'",
                f"expected a non-negative integer, got '{written}' ({why})")
    # a number key (not an integer one), through --set
    ok = write_config(_job(digits_h5), "ok.yaml")
    _user_error(run_cli_here("graph", ok, "--set", f"solver.weight_decay={written}"),
                "solver.weight_decay", why)


# ------------------------------------------------------ empty path options
@pytest.mark.parametrize("option", ["--resume", "--init", "--out"])
def test_an_empty_path_option_is_a_usage_error(write_config, digits_h5, tmp_path, option):
    """``train JOB --resume "$CKPT"`` with CKPT unset trained afresh, exit 0
    (and ``--init ''`` from fresh weights, ``--out ''`` into runs/<name>/<N>):
    an empty value read as the option left out (before the fix:
    ``assert res.returncode == 2`` failed, 0)."""
    path = write_config(_job(digits_h5), "job.yaml")
    out = [] if option == "--out" else ["--out", tmp_path / "run"]
    res = run_cli_here("train", path, "--iters", "1", *out, option, "", cwd=tmp_path)
    _user_error(res, f"argument {option}: an empty path", limit=3000)
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("args", [
    ["plan", "JOB", "--choose", "--calibration", ""],
    ["plan", "JOB", "--choose", "--network", ""],
    ["inspect", "JOB", "--diff", ""],
    ["data", "lmdb-to-h5", "--from", "lmdb", "--test-from", "", "--out", "OUT"],
    ["convert", "caffe", "NET", "--data", "DATA", "--solver", "", "--out", "OUT"],
    ["convert", "caffe", "NET", "--data", "", "--out", "OUT"],
], ids=lambda a: f"{a[0]}{a[a.index('') - 1]}")
def test_every_empty_path_option_is_a_usage_error(write_config, digits_h5, tmp_path, args):
    """The path options the first sweep left out: ``plan --choose
    --calibration ''`` (or --network '') chose with the default op times or
    link, exit 0; ``convert caffe --solver ''`` wrote a job with the default
    solver, exit 0 (before the fix: ``assert res.returncode == 2`` failed, 0);
    ``inspect --diff ''``, ``data --test-from ''``, ``convert --data ''``
    read as the option left out, or gave '' to the command."""
    job = write_config(_job(digits_h5), "job.yaml")
    net = os.path.join(REPO, "tests", "fixtures", "caffe", "lenet_digits.prototxt")
    out = tmp_path / "out.h5"
    args = [{"JOB": job, "NET": net, "OUT": out, "DATA": digits_h5}.get(a, a) for a in args]
    option = args[args.index("") - 1]
    res = run_cli_here(*args, cwd=tmp_path)
    _user_error(res, f"argument {option}: an empty path", limit=3000)
    assert not out.exists() and not (tmp_path / "runs").exists()


# ----------------------------------------------------------------- case 10
#: nine levels of nine aliases: 9^9 (387 million) values in 10 short lines,
#: where a value is checked (and was quoted whole in the message)
LAUGHS = "solver:\n  lr_policy: multistep\n  stepvalues:\n" + "".join(
    f"    - &{name} [{', '.join([f'*{prev}' if prev else 'lol'] * 9)}]\n"
    for prev, name in zip([None, *"abcdefgh"], "abcdefghi"))


def test_case10_billion_laughs_is_refused_fast_with_a_short_message(write_config, digits_h5):
    """Case 10: nested aliases that expand to 9^9 values (6dff0b5: 57 s and
    6.8 GB per process, then a gigabyte-long message; under a 2 GB address
    space it dies within seconds, exit 1, or runs past the 20 s timeout)."""
    cfg = small_net_config(digits_h5)
    del cfg["solver"]
    text = yaml.safe_dump(cfg, sort_keys=False) + LAUGHS
    path = write_config(text, "laughs.yaml")
    start = time.monotonic()
    res = _limited("graph", path)
    assert time.monotonic() - start < 15
    last = len(text.splitlines())  # the line of the aliases that repeat the most
    _user_error(res, f"laughs.yaml:{last}", "over the limit of", "alias")


def test_case10_a_huge_value_is_quoted_as_a_short_excerpt(write_config, digits_h5):
    """Case 10: a 100,000-item decreasing stepvalues list (6dff0b5: the
    whole list in the message, 700 KB; 5 MB for a million)."""
    text = _job(digits_h5).replace(
        "lr_policy: fixed", "lr_policy: multistep\n  stepvalues:\n" + "".join(
            f"  - {i}\n" for i in range(100000, 0, -1)).rstrip("\n"))
    path = write_config(text, "steps.yaml")
    err = _user_error(_limited("graph", path, timeout=60), "solver.stepvalues",
                      "a list of 100000 items")
    assert "[100000, 99999, " in err


def test_excerpt_cuts_long_values_and_gives_their_size():
    from purine_mpi.base.errors import excerpt
    assert excerpt([1, 2]) == "[1, 2]" and excerpt("ab") == "'ab'"
    text = excerpt(list(range(10 ** 6)), limit=50)
    assert text == str(list(range(30)))[:50] + "... (a list of 1000000 items)"
    assert excerpt("x" * 10 ** 6, limit=20).endswith("... (1000000 characters)")
    assert len(excerpt({"k": [[0] * 1000] * 1000})) < 200
    assert "bits" in excerpt(10 ** 5000)  # no ValueError past Python's 4300 digits


def test_shared_values_through_anchors_still_load(write_config, digits_h5):
    """Anchors stay allowed (the key checks advise them, and a dumper writes
    them for shared values): a filler shared by two layers."""
    cfg = small_net_config(digits_h5)
    filler = {"type": "gaussian", "std": 0.01}
    cfg["net"][0]["weight_filler"] = filler
    cfg["net"][3]["weight_filler"] = filler
    text = yaml.safe_dump(cfg, sort_keys=False)
    assert "&id001" in text and "*id001" in text
    res = run_cli_here("graph", write_config(text, "shared.yaml"))
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------- case 11
@pytest.mark.parametrize("style", ["flow", "block"])
def test_case11_deep_nesting_exits_2_naming_the_line(write_config, style):
    """Case 11 (first half): YAML nested 1000 deep (6dff0b5: a 3,000-line
    RecursionError, exit 1)."""
    if style == "flow":
        text = "name: deep\nsolver: {base_lr: " + "[" * 1000 + "]" * 1000 + "}\n"
        line = 2
    else:
        text = "name: deep\n" + "".join(" " * i + "k:\n" for i in range(1000))
        line = 1 + 64  # the mapping of line 65 is the 64th level, its key the 65th
    path = write_config(text, f"deep_{style}.yaml")
    _user_error(_limited("graph", path), f"deep_{style}.yaml:{line}", "deeper than 64")


# ----------------------------------------------------------------- case 18
BAD_VARS = {"PURINE_DATA_MEMORY_MB": "abc", "PURINE_THREADS": "-1",
            "PURINE_DISPATCHER": "bogus", "PURINE_COMM_DELAY": "x",
            "PURINE_CUDNN_BENCHMARK": "maybe", "PURINE_PROGRESS_SECONDS": "soon",
            "PURINE_CONV": "fast"}


def test_case18_bad_purine_variables_exit_2_naming_them(write_config, digits_h5, tmp_path):
    """Case 18 (first half): PURINE_DATA_MEMORY_MB=abc (6dff0b5: exit 1, a
    ValueError not naming the variable); the others ran on a default or a
    fallback (PURINE_THREADS=-1, PURINE_CONV=fast, ...), exit 0."""
    path = write_config(_job(digits_h5), "job.yaml")
    for name, value in BAD_VARS.items():
        res = _limited("train", path, "--iters", "0", "--out", tmp_path / name,
                       extra_env={name: value})
        _user_error(res, f"environment variable {name} must be", repr(value))


def test_every_purine_variable_is_in_the_table_and_the_readme():
    """Every PURINE_* name the package reads is in env.VARS, and the docs'
    table (docs/environment.md, linked from the README) lists exactly those."""
    from purine_mpi.base import env
    used = set()
    for folder, _, files in os.walk(os.path.join(REPO, "purine_mpi")):
        for name in files:
            if name.endswith(".py"):
                used |= set(re.findall(r"\bPURINE_[A-Z0-9_]+\b",
                                       open(os.path.join(folder, name)).read()))
    # the cuda/*.cu macros the Python side names in comments (block sizes)
    kernel_macros = set()
    for name in os.listdir(os.path.join(REPO, "cuda")):
        if name.endswith((".cu", ".cuh")):
            text = open(os.path.join(REPO, "cuda", name)).read()
            kernel_macros |= set(re.findall(r"#\s*define\s+(PURINE_[A-Z0-9_]+)", text))
    assert used - kernel_macros == set(env.VARS)
    readme = open(os.path.join(REPO, "docs", "environment.md")).read()
    table = set(re.findall(r"^\| `(PURINE_[A-Z0-9_]+)` \|", readme, re.M))
    assert table == set(env.VARS)
    for var in env.VARS.values():
        assert var.kind in readme, var.name


def test_env_values_parse_like_config_keys():
    from purine_mpi.base import env
    assert env.get("PURINE_THREADS", {"PURINE_THREADS": " 3 "}) == 3
    assert env.get("PURINE_THREADS", {"PURINE_THREADS": ""}) is None
    assert env.get("PURINE_CUDNN_BENCHMARK", {}) is True
    assert env.get("PURINE_CUDNN_BENCHMARK", {"PURINE_CUDNN_BENCHMARK": "Off"}) is False
    assert env.get("PURINE_COMM_DELAY", {"PURINE_COMM_DELAY": "5:7"}) == (0.005, 7)
    assert env.get("PURINE_DATA_MEMORY_MB", {"PURINE_DATA_MEMORY_MB": "0.5"}) == 0.5
    with pytest.raises(env.EnvError, match="PURINE_MPI_CUDA_AWARE must be 0 or 1"):
        env.check_all({"PURINE_MPI_CUDA_AWARE": "2"})
    with pytest.raises(ValueError):  # an EnvError is a ValueError, as before
        env.get("PURINE_COMM_DELAY", {"PURINE_COMM_DELAY": "3:"})
