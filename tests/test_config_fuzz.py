"""The promise of docs/failures.md, fuzzed: a bad config names the file, the
key and what was expected (exit 2, one line, no traceback). The job files
of jobs/*.yaml are mutated one key at a time (tests/config_fuzz.py: wrong
types, out-of-range numbers, NaN/inf, empty values, unknown keys at every
level, broken layer entries, shapes that cannot work, parallel keys against
--np, missing paths) and run in this process through ``graph`` and ``plan
--np N``; a value the command accepts must be of the type docs/config.md
gives the key. ``python -m tests.config_fuzz`` runs every mutation (about
10,000); this test a seeded sample, and one case per bug the fuzzer found,
each quoting what the code before printed."""
import copy
import random
import re

import pytest
import yaml

from tests import config_fuzz as fz
from tests.conftest import run_cli_here

#: the jobs the sample draws from: small graphs (GoogLeNet's and NIN's
#: builds take 0.1-0.5 s each; their keys are cifar10_quick's)
SAMPLED_JOBS = ("cifar10_quick", "digits_hybrid", "digits_lenet", "digits_pipeline", "gpt_tiny")
SAMPLE = 100


@pytest.fixture(scope="module")
def folder(tmp_path_factory, digits_h5, email_h5):
    return fz.make_data(str(tmp_path_factory.mktemp("fuzz")), digits_h5, email_h5)


@pytest.fixture(scope="module")
def jobs():
    return fz.load_jobs()


def _run(folder, jobs, m, command):
    status, err, _ = fz.run_case(m, folder, command)
    return fz.classify(m, status, err, fz.doc_types(), jobs), status, err


def test_seeded_sample_keeps_the_promise(folder, jobs):
    """SAMPLE mutations (seed 55) through graph, and every parallel key's
    through plan --np N too: none is a traceback, a hang, exit 2 without
    the file or the key, or a value accepted that docs/config.md refuses."""
    # the sampled jobs' mutations alone: each job's list depends on that job
    # only, so this is the same list in the same order as every job's
    # filtered (the same sample), without deep-copying GoogLeNet's, NIN's and
    # the GPT-2s' configs ~4,800 times (checked: 5,365 equal mutations, 52 ->
    # 6 s on the loaded 2-core machine)
    cases = fz.mutations({name: raw for name, raw in jobs.items() if name in SAMPLED_JOBS})
    sample = random.Random(55).sample(cases, SAMPLE)
    bad = []
    for m in sample:
        commands = ("graph", "plan") if m.key.startswith("parallel") else ("graph",)
        for command in commands:
            cls, status, err = _run(folder, jobs, m, command)
            if cls in fz.BAD:
                bad.append(f"{m.name} ({command}): {cls}: {status} {err.strip()[-300:]}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------- one case per bug found
def _job(jobs, name, change):
    cfg = copy.deepcopy(jobs[name])
    change(cfg)
    return cfg


def _err(folder, cfg, *args, name="job.yaml"):
    path = f"{folder}/{name}"
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    res = run_cli_here(*(args[:1] + (path,) + args[1:]), cwd=folder)
    return res.returncode, res.stderr.strip()


def _one_line(status, err, *needles):
    assert status == 2, (status, err)
    assert "\n" not in err and "Traceback" not in err, err
    assert re.search(r"job\.yaml:\d+: key '", err), err  # FILE:LINE: key '...'

    for needle in needles:
        assert needle in err, (needle, err)


def test_a_shape_that_cannot_work_names_the_layer_key(folder, jobs):
    """Before: ``error: op 'conv1.fwd' (Conv) with inputs 'data' [32, 1, 8,
    8], ...: Conv kernel [4000, 4000] (dilation [1, 1]) does not fit the
    padded input [10, 10]`` (neither the file nor a key); the same for a
    pool, an eltwise of two widths and a concat along a mismatched axis."""
    cfg = _job(jobs, "digits_lenet", lambda c: c["net"][0].update(kernel=4000))
    _one_line(*_err(folder, cfg, "graph"), "key 'net[0].kernel'", "layer 'conv1' (conv)",
              "does not fit the padded input [10, 10]")
    cfg = _job(jobs, "gpt_tiny", lambda c: c["net"][8].update(num_output=129))  # h0_proj
    _one_line(*_err(folder, cfg, "graph"), "key 'net[9].bottom'", "layer 'h0_res2' (eltwise)",
              "Eltwise needs inputs of one shape")


def test_data_that_does_not_fit_its_spec_names_the_spec_key(folder, jobs):
    """Before (graph and plan): ``error: data file '.../digits.h5' has no
    group '/nosuch' (groups: test, train); check the data spec's 'split'``,
    ``error: data file 'data' not found; ...`` for a folder, ``error: mean
    file 'no_such_mean.binaryproto' not found``: no config file, no key."""
    cfg = _job(jobs, "digits_lenet", lambda c: c["data"]["train"].update(split="nosuch"))
    _one_line(*_err(folder, cfg, "graph"), "key 'data.train.split'", "no group '/nosuch'")
    cfg = _job(jobs, "digits_lenet", lambda c: c["data"]["train"].update(path="data"))
    _one_line(*_err(folder, cfg, "plan"), "key 'data.train.path'", "is a folder, not a file")
    cfg = _job(jobs, "digits_lenet", lambda c: c["data"]["train"].update(
        mean_file="no_such_mean.binaryproto"))
    _one_line(*_err(folder, cfg, "graph"), "key 'data.train.mean_file'", "not found")
    cfg = _job(jobs, "digits_lenet", lambda c: c["data"]["train"].update(mean=[1, 2, 3]))
    _one_line(*_err(folder, cfg, "graph"), "key 'data.train.mean'", "3 values")


@pytest.mark.parametrize("change, needles", [
    # before: TypeError: unhashable type: 'list' (registry._check_filler)
    (lambda c: c["net"][0].update(weight_filler={"type": ["xavier"]}),
     ("key 'net[0].weight_filler'", "expected a filler")),
    # before: TypeError: 'int' object is not iterable (replica.net_layers: the
    # test-only accuracy's bottom was never checked in the train phase)
    (lambda c: c["net"][10].update(bottom=5),
     ("key 'net[10].bottom'", "expected a blob name or a list of names, got 5")),
    # before: exit 0, the param list silently ignored (every lr_mult 1)
    (lambda c: c["net"][0].update(param=5),
     ("key 'net[0].param'", "expected a list of {lr_mult, decay_mult} mappings")),
    # before: exit 2 naming the next layer's key: "key 'net[3].bottom': layer 'conv2':
    # bottom blob 'pool1' is not produced by ... (available: , conv1, data, label)"
    (lambda c: c["net"][2].update(top=""), ("key 'net[2].top'", "expected a blob name")),
    # before: KeyError: 'fc2' (a train-phase accuracy is not copied per micro-batch)
    (lambda c: (c["net"][10].pop("phase"), c["parallel"].update(micro_batches=2)),
     ("key 'net[10].phase'", "phase: test")),
    # before: OverflowError: Python int too large to convert to C long
    (lambda c: c["data"]["train"].update(batch_size=1e30),
     ("key 'data.train.batch_size'", "below 2^63")),
    # before: exit 0 (train: 'run folder job.yaml: cannot set it up: File exists')
    (lambda c: c["checkpoint"].update(folder="job.yaml"),
     ("key 'checkpoint.folder'", "which is a file")),
])
def test_lenet_mutation_is_one_line_naming_the_key(folder, jobs, change, needles):
    _one_line(*_err(folder, _job(jobs, "digits_lenet", change), "graph"), *needles)


def test_stages_out_of_order_name_parallel_stages(folder, jobs):
    """Before: ``error: the graph has a cycle through ops: conv1.bwd...``
    (no file, no key) for relu3 put on stage 0 after fc1 on stage 1."""
    cfg = _job(jobs, "digits_hybrid", lambda c: c["parallel"]["stages"].update(relu3=0))
    _one_line(*_err(folder, cfg, "graph", "--np", "4"), "key 'parallel.stages'",
              "layer relu3 on stage 0 reads 'fc1' of layer fc1 on stage 1")


def test_ps_ranks_against_the_world_names_file_and_key(folder, jobs):
    """Before: ``error: parallel.ps_ranks is 4, but a parameter-server run
    needs at least one server and one worker: ...`` (no file)."""
    cfg = _job(jobs, "digits_lenet", lambda c: c["parallel"].update(mode="sync_ps",
                                                                      ps_ranks=4))
    _one_line(*_err(folder, cfg, "graph", "--np", "2"), "key 'parallel.ps_ranks'",
              "start at least 5 ranks (this job has 2)")


def test_cosine_with_max_iter_zero_is_a_valid_job(folder, jobs):
    """solver.max_iter 0 is documented (integer >= 0: nothing to train, as
    --iters 0). Before, with lr_policy cosine or poly: ``error: key
    'solver.max_iter': must be > 0, got 0.0`` (exit 2 from graph, no file)."""
    for policy in ("cosine", "poly"):
        cfg = _job(jobs, "digits_lenet", lambda c: c["solver"].update(lr_policy=policy,
                                                                        max_iter=0))
        status, err = _err(folder, cfg, "graph")
        assert status == 0, err


def test_a_test_spec_that_does_not_fit_names_its_key(folder, jobs, digits_h5):
    """The test split's spec, read at train's start-up (data_notes) and by
    graph --phase test. Before (train --iters 1, split: null): ``error:
    data file '.../digits.h5' has no top-level 'data' dataset; it has the
    groups test, train: set the data spec's 'split' to one`` (no file, no
    key); graph --phase test the same."""
    from purine_mpi.base.errors import ConfigError
    from purine_mpi.job.data_spec import data_notes
    from tests.conftest import make_job
    def change(c):
        c["data"]["train"]["path"] = digits_h5
        c["data"]["test"].update(split=None, path=digits_h5)
    cfg = _job(jobs, "digits_lenet", change)
    with pytest.raises(ConfigError) as e:
        data_notes(make_job(cfg, "job.yaml"))
    assert str(e.value).startswith("job.yaml: key 'data.test.split': data file"), str(e.value)
    _one_line(*_err(folder, cfg, "graph", "--phase", "test"), "key 'data.test.split'")
