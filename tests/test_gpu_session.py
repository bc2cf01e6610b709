"""benchmarks/gpu_session.sh and benchmarks/gpu_probe.py without a GPU: the
stages fit one 10-minute command together, ``fetch`` downloads
exactly the pinned wheels for the pinned Python, a stage installs only what
the interpreter lacks and records the environment, and the probe's checks
say FAIL or SKIP with one line why on a machine without a GPU (no
traceback)."""
import contextlib
import json
import os
import pathlib
import re
import signal
import stat
import subprocess
import sys
import tarfile
import time

import pytest

from tests.conftest import REPO, cli_env

BENCH = pathlib.Path(REPO) / "benchmarks"
SCRIPT, PROBE, PINS = BENCH / "gpu_session.sh", BENCH / "gpu_probe.py", BENCH / "gpu_wheels.txt"
STAGES = ["tests", "gpt", "learn", "bench", "probe", "bench-quick", "dp", "plans"]   # `all`


def _session(*args, env=None, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=dict(cli_env(), **(env or {})), timeout=timeout)


def _pins():
    lines = [line.strip() for line in PINS.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_plan_lists_the_stages_in_order_and_the_calls_they_need(tmp_path):
    res = _session("--plan")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    total_at = next(i for i, line in enumerate(lines) if line.startswith("total"))
    rows = [line.split() for line in lines[1:total_at]]
    assert [r[0] for r in rows] == STAGES
    budgets = dict((r[0], int(r[1].rstrip("s"))) for r in rows)
    assert all(0 < b <= 600 for b in budgets.values()) and budgets["probe"] <= 120
    # each row says how long the stage took on an H200 (seconds, then when)
    assert all(re.fullmatch(r"\d+[+?]?", r[2]) and r[3] == "s" for r in rows), rows
    assert int(lines[total_at].split()[1].rstrip("s")) == sum(budgets.values())
    # the calls: every stage once, in order, each call's budgets within 590 s
    sessions_at = next(i for i, line in enumerate(lines) if line.startswith("sessions"))
    calls = [line.split()[1:] for line in lines[total_at + 2:sessions_at]]
    assert [line.split()[0] for line in lines[total_at + 2:sessions_at]] == \
        ["benchmarks/gpu_session.sh"] * len(calls)
    assert sum(calls, []) == STAGES and len(calls) == 3   # learn: a call of its own
    assert all(sum(budgets[s] for s in call) <= 590 for call in calls), calls
    # the sessions: 900 s of device time each, a start of 30 s and 30 s for the
    # transfers and hand-back; `tests gpt` and all of learn's 575 s do not fit
    # one, so learn gets what is left (CALL_BUDGET_S), the rest a second session
    assert 30 + budgets["tests"] + budgets["gpt"] + budgets["learn"] + 30 > 900
    left = 900 - 30 - budgets["tests"] - budgets["gpt"] - 30
    assert lines[sessions_at + 1:] == [
        f"  session 1 (900 s): benchmarks/gpu_session.sh tests gpt, then "
        f"CALL_BUDGET_S={left} benchmarks/gpu_session.sh learn (cut from "
        f"{budgets['learn']} s: it uses what it is given; where the calls before took "
        f"less, the device tool's budget_left_s less 40, up to 590)",
        f"  session 2 ({30 + sum(budgets[s] for s in calls[2]) + 30} s): "
        f"benchmarks/gpu_session.sh {' '.join(calls[2])}"], lines[sessions_at:]
    # a shorter lease: learn's whole call alone is over it, and says so
    short = _session("--plan", env={"DEVICE_BUDGET_S": "600"}).stdout.splitlines()
    at = next(i for i, line in enumerate(short) if line.startswith("sessions"))
    assert short[at + 2] == "  session 2 (635 s: over 600 s, cut it with CALL_BUDGET_S): " \
        "benchmarks/gpu_session.sh learn", short[at:]
    assert len(short) == at + 4
    for bad in (("bogus",), ("probe", "bogus"), ("all", "probe"), ("--plan", "x"),
                ("--stage",)):
        res = _session(*bad, env={"OUT": str(tmp_path / "o"), "WORK": str(tmp_path / "w")})
        assert res.returncode == 2 and "usage" in res.stderr and not res.stdout, bad
        assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists(), bad
    for name in ("STAGE_BUDGET_S", "CALL_BUDGET_S"):
        for budget in ("abc", "0", "-5", "1.5"):   # refused before anything is written
            res = _session("probe", env={name: budget, "OUT": str(tmp_path / "o"),
                                         "WORK": str(tmp_path / "w")})
            assert res.returncode == 2 and not res.stdout and not (tmp_path / "o").exists()
            assert res.stderr.strip().endswith(f"{name} must be a whole number of "
                                               f"seconds (> 0), not '{budget}'"), res.stderr
    for name in ("DEVICE_BUDGET_S", "START_S"):
        res = _session("--plan", env={name: "9m"})
        assert res.returncode == 2 and not res.stdout and res.stderr.strip().endswith(
            f"{name} must be a whole number of seconds (> 0), not '9m'"), res.stderr
    res = _session("probe", env={"OUT": str(tmp_path / "o"), "WORK": str(tmp_path / "o/w")})
    assert res.returncode == 2 and "must not be inside OUT" in res.stderr
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_pins_name_the_issue_versions_and_fetch_downloads_exactly_them(tmp_path):
    pins = _pins()
    for name, version in {"nvmath-python": "1.0.0", "cuda-bindings": "13.5.0",
                          "cuda-core": "1.2.2", "cuda-pathfinder": "1.9.1",
                          "nvidia-cudnn-frontend": "1.32.0", "mpich": "5.0.2",
                          "mpi4py": "4.1.2"}.items():
        assert pins[name] == version, name
    assert {"PyYAML", "h5py", "pytest"} <= set(pins)
    python = re.search(r"python-version: *([0-9.]+)", PINS.read_text()).group(1)
    # a stand-in interpreter records what fetch asks pip for (no network here)
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    res = _session("fetch", env={"PYTHON": str(stub), "WHEELS": str(tmp_path / "w")})
    assert res.returncode == 0, res.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[:3] == ["-m", "pip", "download"] and "--no-deps" in args
    assert args[args.index("--python-version") + 1] == python
    assert args[args.index("-d") + 1] == str(tmp_path / "w")
    assert sorted(a for a in args if "==" in a) == sorted(f"{n}=={v}" for n, v in pins.items())


def _check_lines(text):
    rows = [line.split(None, 2) for line in text.strip().splitlines()]
    assert rows and all(r[0] in ("PASS", "FAIL", "SKIP") and len(r) == 3 for r in rows), text
    return {r[1]: (r[0], r[2]) for r in rows}


def test_probe_says_fail_or_skip_in_one_line_each_without_a_gpu(tmp_path):
    """On this machine (no CuPy, no device, no nvmath): each GPU assumption
    is a FAIL or a SKIP naming why, the exit status is 1, no traceback."""
    res = subprocess.run([sys.executable, str(PROBE), "--out", str(tmp_path)],
                         capture_output=True, text=True, env=cli_env(), timeout=90)
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr, res.stderr
    checks = _check_lines(res.stdout)
    assert list(checks) == ["python", "wheels", "pip-check", "cuda-device", "nvmath-capture",
                            "cudnn-capture", "memcpy-replay", "abort-capture", "nccl-capture",
                            "mpi-world-2"]
    assert checks["cuda-device"][0] == "FAIL" and "CuPy" in checks["cuda-device"][1]
    for name in ("nvmath-capture", "cudnn-capture", "memcpy-replay", "abort-capture",
                 "nccl-capture"):
        assert checks[name] == ("SKIP", "needs a CUDA device (see cuda-device)"), name
    assert checks["wheels"][0] == "FAIL" and "nvmath-python" in checks["wheels"][1]
    assert checks["mpi-world-2"][0] == "PASS"   # the venv's mpich + mpi4py
    report = json.loads((tmp_path / "probe.json").read_text())
    assert "cuda-device" in report["failed"] and len(report["probe"]) == 10
    assert (tmp_path / "probe.txt").read_text().strip() == res.stdout.strip()


def test_probe_stage_installs_only_what_is_missing_and_records_the_environment(tmp_path):
    """``gpu_session.sh probe``: the pins the interpreter has are kept (never
    reinstalled), the rest installed from the carried wheels (none here: the
    install fails and says so); env.txt holds pip list, pip check, the cuDNN
    line and the architecture; the plan cache goes under $OUT. The stage's
    60 s budget is a GPU machine's: on a loaded 2-core machine install +
    env.txt + probe took over it and the probe was cut (``probe probe 124``,
    no probe.json), so the stage gets 300 s here (STAGE_BUDGET_S)."""
    out, back = tmp_path / "work", tmp_path / "out"
    res = _session("probe", env={"OUT": str(back), "WORK": str(out),
                                 "WHEELS": str(tmp_path / "none"),
                                 "PYTHON": sys.executable, "PIP_FIND_LINKS": "",
                                 "STAGE_BUDGET_S": "300"}, timeout=330)
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    # what comes back: the archive of the work folder (no cache) and the summary
    assert sorted(os.listdir(back)) == ["gpu_session.tgz", "summary.txt"]
    with tarfile.open(back / "gpu_session.tgz") as tar:
        names = {name.lstrip("./") for name in tar.getnames()}
    assert {"install.log", "status.txt", "env.txt", "probe.txt", "probe.json",
            "stages.txt", "summary.txt"} <= names and not any("cache" in n for n in names)
    summary = (back / "summary.txt").read_text()
    assert re.search(r"^probe failed\(1\) \d+ \(budget 300 s\)$", summary, re.M), summary
    assert "probe install_deps 1" in summary and re.search(r"^probe: \d+ of 10 PASS$",
                                                           summary, re.M), summary
    _check_lines(res.stdout.split("probe install")[0])
    log = (out / "install.log").read_text()
    assert "kept the image's 4.1.2 for mpi4py==4.1.2" in log
    assert "nvmath-python" in log and "kept the image's" not in \
        [line for line in log.splitlines() if "nvmath-python" in line][0]
    status = (out / "status.txt").read_text().split("\n")
    assert "probe install_deps 1" in status and "probe probe 1" in status
    env = (out / "env.txt").read_text()
    for part in ("-- pip list", "-- pip check", "cuDNN frontend", "machine: ", "python "):
        assert part in env, part
    assert (out / "cache").is_dir() and os.path.exists(out / "probe.json")


def test_the_probes_gpu_checks_pass_on_the_emulated_gpu(host_build_dir, monkeypatch, tmp_path):
    """The probe's own code (captures, replays, the abort path, NCCL) runs
    on the emulated CuPy, cuDNN frontend, nvmath and NCCL before any GPU
    does. The device's properties are supplied here (the emulator has none).
    The abort path fails for the reason a GPU gives: the capturing stream's
    ``streamSynchronize`` is refused."""
    import importlib.util
    import sys as _sys
    from tests.emulated_gpu import use_emulated_cupy
    from tests.emulated_gpu.cudnn import FakeCudnn
    from tests.emulated_gpu.nccl import use_emulated_nccl
    monkeypatch.setenv("PURINE_CACHE_DIR", str(tmp_path / "cache"))
    fake = use_emulated_cupy(monkeypatch, host_build_dir)
    monkeypatch.setitem(_sys.modules, "cudnn", FakeCudnn())
    use_emulated_nccl(monkeypatch, fake)
    monkeypatch.setattr(fake.cuda.runtime, "getDeviceProperties",
                        lambda d: {"name": b"NVIDIA Emulated GPU"}, raising=False)
    monkeypatch.setattr(fake.cuda.runtime, "runtimeGetVersion", lambda: 12080, raising=False)
    monkeypatch.setattr(fake.cuda, "Device", type("Device", (fake.cuda.Device,),
                                                  {"compute_capability": "90"}))
    from purine_mpi.gpu import blas, cudnn
    blas.reset()
    cudnn.reset()
    spec = importlib.util.spec_from_file_location("gpu_probe_emulated", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    ctx = {"pins": {}, "python": None, "nodeps": set(), "wheels": str(PINS)}
    results = {name: probe.run_check(fn, ctx) for name, fn in probe.CHECKS
               if name in ("cuda-device", "nvmath-capture", "cudnn-capture", "memcpy-replay",
                           "abort-capture", "nccl-capture")}
    assert {name: status for name, (status, _) in results.items()} == dict.fromkeys(
        results, "PASS"), results
    assert "replayed twice" in results["nccl-capture"][1]
    assert "cudaErrorStreamCaptureUnsupported" in results["abort-capture"][1], results
    blas.reset()
    cudnn.reset()


def _stub_python(tmp_path, pytest_sleeps=False, sleeps_on=None, sleep_s=300, pytest_s=0):
    """An interpreter standing in for the GPU machine's: ``-m pytest``
    records its pid, then (after ``pytest_s`` seconds) writes a pytest
    tally and a JUnit XML (one passing GPU-only check) or
    (``pytest_sleeps``) sleeps 300 s; pip (the
    install, pip list) and env.txt's script say one line (seconds each on a
    loaded CPU otherwise); anything else is the real interpreter."""
    stub = tmp_path / "python"
    act = "exec sleep 300" if pytest_sleeps else f"""
  sleep {pytest_s}
  for a in "$@"; do case "$a" in --junitxml=*) xml="${{a#--junitxml=}}" ;; esac; done
  echo '<testsuites><testsuite><testcase classname="tests.test_gpu_kernel_options" \
name="test_a_kernel_keeps_subnormals_on_the_gpu"/></testsuite></testsuites>' > "$xml"
  echo "1 passed in 0.01s"
  exit 0"""
    sleeper = "" if sleeps_on is None else f"""
case "$*" in *"{sleeps_on}"*) echo $$ > {tmp_path}/sleeper.pid; exec sleep {sleep_s} ;; esac"""
    stub.write_text(f"""#!/bin/sh{sleeper}
if [ "$1 $2" = "-m pip" ] || [ "$*" = "-" ]; then
  cat > /dev/null; echo "stand-in python: $*"; exit 0
fi
if [ "$1 $2" = "-m pytest" ]; then
  echo $$ > {tmp_path}/pytest.pid
  {act}
fi
exec {sys.executable} "$@"
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return stub


def recording_python(tmp_path, scripts):
    """An interpreter standing in for the GPU machine's: a script matching
    the shell pattern ``scripts`` appends its arguments to
    ``tmp_path/calls.txt``, prints ``{}`` and exits 0; pip and env.txt's
    script say one line; anything else is the real interpreter.
    ``(stub, calls)``. (Also tests/test_learn_gpu.py's.)"""
    stub = tmp_path / "python"
    calls = tmp_path / "calls.txt"
    stub.write_text(f"""#!/bin/sh
if [ "$1 $2" = "-m pip" ] || [ "$*" = "-" ]; then
  cat > /dev/null; echo "stand-in python: $*"; exit 0
fi
case "$1" in
  {scripts}) echo "$*" >> {calls}; echo '{{}}'; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return stub, calls


def _archived(back):
    with tarfile.open(back / "gpu_session.tgz") as tar:
        return {name.lstrip("./") for name in tar.getnames()}


def _wait_for(predicate, runner, deadline):
    while not predicate():
        assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()
        time.sleep(0.5)


@contextlib.contextmanager
def _call_to_kill(tmp_path, stages, **stub):
    """gpu_session.sh ``stages`` started in the background with the stand-in
    interpreter (``_stub_python(tmp_path, **stub)``), OUT and WORK in
    ``tmp_path``, no wheels, 200 s a stage: yields ``(runner, work, back)``
    and kills the call if it still runs at the end."""
    work, back = tmp_path / "work", tmp_path / "out"
    env = dict(cli_env(), OUT=str(back), WORK=str(work),
               PYTHON=str(_stub_python(tmp_path, **stub)),
               WHEELS=str(tmp_path / "none"), PIP_FIND_LINKS="", STAGE_BUDGET_S="200")
    runner = subprocess.Popen(["bash", str(SCRIPT), *stages], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield runner, work, back
    finally:
        if runner.poll() is None:
            runner.kill()


def _terminate(runner, timeout):
    """TERM to the call, as the device tool at its limit: its (stdout, stderr)."""
    runner.send_signal(signal.SIGTERM)
    return runner.communicate(timeout=timeout)


def test_a_call_killed_mid_stage_still_leaves_the_stages_done_packed(tmp_path):
    """``plans tests``: the plans stage ends (failing: no GPU here) and its
    reports are packed at once; the call is killed (TERM, as the device
    tool at its limit) while the tests stage's pytest runs: that pytest is
    ended with it, and $OUT holds the archive (both stages' files so far,
    no cache) and the summary saying so, nothing else."""
    with _call_to_kill(tmp_path, ["plans", "tests"], pytest_sleeps=True) as (runner, work,
                                                                            back):
        deadline = time.monotonic() + 240
        _wait_for(lambda: (back / "summary.txt").is_file(), runner, deadline)
        assert sorted(os.listdir(back)) == ["gpu_session.tgz", "summary.txt"]
        assert {"cudnn_plans.json", "cudnn_plans.log", "status.txt"} <= _archived(back)
        _wait_for(lambda: (tmp_path / "pytest.pid").is_file(), runner, deadline)
        stdout, stderr = _terminate(runner, 60)
    assert runner.returncode == 143, (stdout, stderr)
    assert sorted(os.listdir(back)) == ["gpu_session.tgz", "summary.txt"]
    names = _archived(back)
    assert {"cudnn_plans.json", "env.txt", "stages.txt", "summary.txt"} <= names
    assert not any("cache" in n for n in names), names
    summary = (back / "summary.txt").read_text()
    assert re.search(r"^plans failed\(\d+\) \d+ \(budget 200 s\)$", summary, re.M), summary
    assert re.search(r"^tests killed\(TERM\) \d+$", summary, re.M), summary
    assert "cudnn_plans.json: empty" in summary
    time.sleep(1)
    pid = int((tmp_path / "pytest.pid").read_text())
    with pytest.raises(ProcessLookupError):   # the stage's pytest was ended too
        os.kill(pid, 0)


def test_a_call_killed_in_a_step_of_its_own_timeout_ends_at_once(tmp_path):
    """The gpt stage's first steps have timeouts of their own (40, 30,
    25 s); GNU timeout runs its command in a process group of its own, so
    only the stage's trap can end it. Killed (TERM) while the bf16 bench
    runs, the call ends within seconds, not when that step's timeout
    expires, packed, and the bench is gone."""
    with _call_to_kill(tmp_path, ["gpt"], sleeps_on="--precision bf16") as (runner, work,
                                                                              back):
        _wait_for(lambda: (tmp_path / "sleeper.pid").is_file(), runner,
                  time.monotonic() + 120)
        killed = time.monotonic()
        stdout, stderr = _terminate(runner, 90)
        took = time.monotonic() - killed
    assert runner.returncode == 143 and took < 15, (took, stdout, stderr)
    summary = (back / "summary.txt").read_text()
    assert re.search(r"^gpt killed\(TERM\) \d+$", summary, re.M), summary
    assert "env.txt" in _archived(back)
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "sleeper.pid").read_text()), 0)


def test_a_call_killed_between_stages_says_so_not_that_a_finished_stage_was_killed(
        tmp_path):
    """TERM while the runner packs after a stage (its summary script
    slowed to 4 s here): the stage stays recorded as it ended, and
    stages.txt says the call was killed between stages."""
    with _call_to_kill(tmp_path, ["plans", "tests"], sleeps_on="gpu_session_summary.py",
                       sleep_s=4) as (runner, work, back):
        _wait_for(lambda: (tmp_path / "sleeper.pid").is_file(), runner,
                  time.monotonic() + 120)
        stdout, stderr = _terminate(runner, 60)
    assert runner.returncode == 143, (stdout, stderr)
    stages = (work / "stages.txt").read_text()
    assert re.search(r"^plans failed\(\d+\) \d+ \(budget 200 s\)$", stages, re.M), stages
    assert "killed(TERM)" not in stages.replace("call killed(TERM) between stages", ""), stages
    assert re.search(r"^call killed\(TERM\) between stages \(after plans\)$", stages, re.M), \
        stages
    assert not (work / "pytest_gpu.txt").exists()
    assert sorted(os.listdir(back)) == ["gpu_session.tgz", "summary.txt"]


def test_a_stage_that_does_not_fit_the_call_is_skipped_and_said(tmp_path):
    """CALL_BUDGET_S=20: the first stage gets the 20 s (not its 120) and
    takes 2 of them (its stand-in pytest), the second has under 20 s left
    and is skipped, which the summary says, and the exit status is 124."""
    work, back = tmp_path / "work", tmp_path / "out"
    res = _session("tests", "plans", env={
        "OUT": str(back), "WORK": str(work),
        "PYTHON": str(_stub_python(tmp_path, pytest_s=2)),
        "WHEELS": str(tmp_path / "none"), "PIP_FIND_LINKS": "", "CALL_BUDGET_S": "20"},
        timeout=120)
    assert res.returncode == 124, res.stderr
    summary = (back / "summary.txt").read_text()
    assert re.search(r"^tests ok \d+ \(budget 20 s\)$", summary, re.M), summary
    assert re.search(r"^plans skipped\(call-budget\) 0 \(\d+ s of CALL_BUDGET_S=20 left\)$",
                     summary, re.M), summary
    assert not (work / "cudnn_plans.json").exists()
    assert "pytest -m gpu: 1 passed in 0.01s" in summary
    assert "GPU-only check test_gpu_kernel_options: 1 passed" in summary
    assert "GPU-only check test_gpu_loss_vec: not run" in summary
    assert sorted(os.listdir(back)) == ["gpu_session.tgz", "summary.txt"]


def test_the_gpt_stage_runs_its_headline_before_the_microbenchmarks(tmp_path):
    """The gpt stage's headline (benchmarks/gpt_gpu.py) cannot be starved by
    the kernel microbenchmarks (loss_kernel_gpu.py 30 s, bias_gelu_gpu.py 25
    s, layernorm_kernel_gpu.py 20 s, adam_copy_gpu.py 15 s, each + 5 s to be
    killed): it runs right
    after the bf16 CNN bench,
    before them, with a deadline that leaves them their caps, and keeps at
    least the 95 s it had (a 105 s stage measured on an H200) even where
    that bench takes its whole 45 s. The benchmarks are stand-ins here that
    record their arguments and return at once."""
    plan = _session("--plan").stdout
    budget = int(re.search(r"^gpt +(\d+)s", plan, re.M).group(1))
    stub, calls = recording_python(tmp_path, "benchmarks/*.py")
    work, back = tmp_path / "work", tmp_path / "out"
    res = _session("gpt", env={"OUT": str(back), "WORK": str(work), "PYTHON": str(stub),
                               "WHEELS": str(tmp_path / "none"), "PIP_FIND_LINKS": ""},
                   timeout=120)
    lines = calls.read_text().splitlines()
    scripts = [line.split()[0] for line in lines]
    assert scripts == ["benchmarks/gpu_throughput.py", "benchmarks/gpt_gpu.py",
                       "benchmarks/loss_kernel_gpu.py", "benchmarks/bias_gelu_gpu.py",
                       "benchmarks/layernorm_kernel_gpu.py", "benchmarks/adam_copy_gpu.py"], \
        (lines, res.stderr)
    gpt = lines[1].split()
    deadline = int(gpt[gpt.index("--deadline-s") + 1])
    assert int(gpt[gpt.index("--budget-s") + 1]) <= deadline - 20, gpt
    # the stage ends 5 s before its budget; the stand-ins took ~0 s
    assert budget - 5 - deadline >= 30 + 25 + 20 + 15 + 4 * 5, (budget, deadline)
    assert deadline - 45 >= 95, (budget, deadline)
    # a stage cut short (STAGE_BUDGET_S=70, under the microbenchmarks' 110 s
    # plus a minute): the headline gets all that is left, a positive budget
    calls.unlink()
    res = _session("gpt", env={"OUT": str(back), "WORK": str(work), "PYTHON": str(stub),
                               "WHEELS": str(tmp_path / "none"), "PIP_FIND_LINKS": "",
                               "STAGE_BUDGET_S": "70"}, timeout=120)
    assert calls.exists(), (res.returncode, res.stderr, (work / "stages.txt").read_text(),
                            (work / "status.txt").read_text())
    gpt = [line.split() for line in calls.read_text().splitlines()
           if line.startswith("benchmarks/gpt_gpu.py")][0]
    deadline = int(gpt[gpt.index("--deadline-s") + 1])
    assert deadline >= 55 and 1 <= int(gpt[gpt.index("--budget-s") + 1]) <= deadline - 20, gpt


def test_the_summary_names_each_side_of_ours_peak_and_what_it_is_made_of(tmp_path):
    """The gpt stage's summary line of each side of ours in gpt_gpu.json
    carries its own peak and ``device_memory`` (issue 45: the cuBLASLt
    side's peak once read twice the default's, with nothing in the summary
    saying what was in use before it): the peak, what was in use before,
    what the side left, the cuBLASLt plans it made and the products refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_session_summary_sides",
                                                  BENCH / "gpu_session_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    side = {"tokens_per_s": 250600.0, "peak_memory_bytes": 9500000000,
            "device_memory": {"peak_bytes": 9500000000, "peak_with_earlier_bytes": 19000000000,
                              "in_use_before_bytes": 9500000000, "left_in_use_after_bytes": 0,
                              "arena_bytes": 7000000000, "cublas_handles": 3,
                              "cublas_workspace_bytes": 100663296, "cublaslt_plans": 5,
                              "cublaslt_refused": 0}}
    path = tmp_path / "gpt_gpu.json"
    path.write_text(json.dumps({"sides": {"purine_fc_cublaslt": side}}))
    (line,) = mod.json_lines(path)
    assert line.startswith("gpt_gpu.json: purine_fc_cublaslt: "), line
    for figure in ("peak_memory_bytes=9500000000", "device_memory.peak_bytes=9500000000",
                   "device_memory.in_use_before_bytes=9500000000",
                   "device_memory.left_in_use_after_bytes=0", "device_memory.cublaslt_plans=5",
                   "device_memory.cublaslt_refused=0", "device_memory.cublas_handles=3",
                   "device_memory.arena_bytes=7000000000"):
        assert figure in line.split(), (figure, line)
