"""A layer of the test phase only (``phase: test``) that cannot work is a
config error (exit 2 naming its key) also where no test graph is built:
``train`` without ``data.test`` and ``graph`` of the train phase (which
reads no test file). Before, the test phase was built only for a test
pass, so such a layer was never reported: the run trained and the
``graph`` printed."""
import re

import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.train.trainer import Trainer
from tests.conftest import FakeWorld, make_job, run_cli_here, tiny_fc_config, write_config_file

KEY = "key 'net[3].bottom': layer 'bad' (eltwise)"


def _config(test_data):
    cfg = tiny_fc_config()
    cfg["net"] += [{"type": "fc", "name": "extra", "bottom": "fc", "top": "x", "num_output": 4,
                    "phase": "test"},
                   {"type": "eltwise", "name": "bad", "bottom": ["x", "fc"], "top": "y",
                    "phase": "test"}]
    if test_data:
        cfg["data"]["test"] = dict(cfg["data"]["train"], path="/no/such/test.h5")
    return cfg


def test_train_without_test_data_reports_a_broken_test_layer(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(KEY)):
        Trainer(make_job(_config(False)), str(tmp_path / "run"), world=FakeWorld(),
                log=lambda m: None)


@pytest.mark.parametrize("test_data", [False, True])
def test_graph_reports_a_broken_test_layer(tmp_path, test_data):
    res = run_cli_here("graph", write_config_file(tmp_path, _config(test_data)))
    assert res.returncode == 2 and KEY in res.stderr, res.stdout[-300:] + res.stderr
    good = _config(test_data)
    good["net"][3]["bottom"] = ["x", "x"]
    res = run_cli_here("graph", write_config_file(tmp_path, good))
    assert res.returncode == 0, res.stderr  # the test file is not read by graph


# ------------------------------------------------- test data of other shapes
def _pooled(train_hw, test_hw, kernel):
    """conv, global pooling and fc (parameters that do not depend on the
    image size) on synthetic images, with a test-only pool layer of
    ``kernel`` (net[5])."""
    def spec(hw):
        return {"source": "synthetic", "shape": [1, hw, hw], "classes": 3, "batch_size": 4,
                "num_samples": 8}
    return {"name": "p", "data": {"train": spec(train_hw), "test": spec(test_hw)},
            "net": [{"type": "conv", "name": "conv", "bottom": "data", "top": "conv",
                     "num_output": 4, "kernel": 3, "pad": 1},
                    {"type": "pool", "name": "gap", "bottom": "conv", "top": "gap",
                     "pool": "ave", "global": True},
                    {"type": "fc", "name": "fc", "bottom": "gap", "top": "fc", "num_output": 3},
                    {"type": "softmax_loss", "name": "l", "bottom": ["fc", "label"], "top": "l"},
                    {"type": "accuracy", "name": "acc", "bottom": ["fc", "label"],
                     "top": "acc", "phase": "test"},
                    {"type": "pool", "name": "window", "bottom": "conv", "top": "w",
                     "pool": "max", "kernel": kernel, "phase": "test"}],
            "solver": {"max_iter": 1}}


@pytest.mark.parametrize("train_hw,test_hw,works", [(12, 8, False), (8, 12, True)])
def test_graph_checks_test_layers_on_the_test_data(tmp_path, train_hw, test_hw, works):
    """``graph`` built the test phase on the train data's shapes although
    data.test gives others: a test-only pool of kernel 10 over 8x8 test
    images was printed (train then refused it), and one over 12x12 test
    images, which works, was refused for the 8x8 train images."""
    config = write_config_file(tmp_path, _pooled(train_hw, test_hw, 10))
    res = run_cli_here("graph", config)
    if works:
        assert res.returncode == 0, res.stderr
    else:
        assert res.returncode == 2 and "key 'net[5].kernel'" in res.stderr, \
            res.stdout[-300:] + res.stderr
    # train's start-up agrees (it builds the test graph on the test data)
    job = make_job(_pooled(train_hw, test_hw, 10))
    if works:
        Trainer(job, str(tmp_path / "run"), world=FakeWorld(), log=lambda m: None)
    else:
        with pytest.raises(ConfigError, match=re.escape("key 'net[5].kernel'")):
            Trainer(job, str(tmp_path / "run"), world=FakeWorld(), log=lambda m: None)


def test_test_images_that_change_a_parameter_are_refused_at_start_up(tmp_path):
    """16x16 train and 12x12 test images into an fc layer after a conv: the
    test graph's fc/weight is [3, 576], the train graph's (the array the
    test pass runs on) [3, 1024]. Before, the run trained to its first test
    pass and failed there (exit 1, InnerProduct's matmul mismatch; a
    ``--force`` had deleted the old run first): now exit 2 at start-up
    naming data.test, in train, in the --force check and in graph."""
    from purine_mpi.job.replica import check_graphs
    cfg = tiny_fc_config()
    cfg["net"].insert(0, {"type": "conv", "name": "conv", "bottom": "data", "top": "conv",
                          "num_output": 4, "kernel": 3, "pad": 1})
    cfg["net"][1]["bottom"] = "conv"
    cfg["data"]["train"]["shape"] = [1, 16, 16]
    cfg["data"]["test"] = dict(cfg["data"]["train"], shape=[1, 12, 12])
    want = "key 'data.test': its samples of shape [1, 12, 12] give layer 'fc' the parameter " \
           "'fc/weight' of shape [3, 576], but the train phase's is [3, 1024]"
    with pytest.raises(ConfigError, match=re.escape(want)):
        Trainer(make_job(cfg), str(tmp_path / "run"), world=FakeWorld(), log=lambda m: None)
    with pytest.raises(ConfigError, match=re.escape(want)):
        check_graphs(make_job(cfg))
    res = run_cli_here("graph", write_config_file(tmp_path, cfg))
    assert res.returncode == 2 and want in res.stderr, res.stderr
    cfg["data"]["test"]["shape"] = [1, 16, 16]  # the train shape: accepted
    check_graphs(make_job(cfg))


def test_another_test_sequence_length_is_accepted(email_h5):
    """A GPT's parameters do not depend on the sequence length: test
    windows of 8 tokens under training on 16 build and share them."""
    from purine_mpi.job.replica import check_graphs
    from tests.gpt_oracle import gpt_net
    spec = {"source": "text", "path": email_h5, "batch_size": 2, "sequence_length": 16}
    check_graphs(make_job({"name": "g", "net": gpt_net(vocab=256, width=8, blocks=1),
                           "data": {"train": spec, "test": dict(spec, sequence_length=8)},
                           "solver": {"max_iter": 1}}))


@pytest.mark.parametrize("mode", ["sync_ps", "async"])
def test_a_parameter_server_finds_the_test_shape_error_as_its_workers(tmp_path, mode):
    """A parameter server builds no test graph, yet it checks the test data
    as the workers do: every rank then finds the error alike, and the job
    prints it once (report_user_error's agreement), exit 2. Before, the
    server went on and each worker printed its own ``error: rank R:`` line
    (mpiexec -n 4, ps_ranks 2: two lines)."""
    import types
    from purine_mpi.train.ps_server import ServerRank
    cfg = tiny_fc_config()
    cfg["data"]["train"]["shape"] = [1, 8, 8]
    cfg["data"]["test"] = dict(cfg["data"]["train"], shape=[1, 10, 10])
    cfg["parallel"] = {"scheme": "data", "mode": mode, "ps_ranks": 1}
    world = types.SimpleNamespace(rank=2, size=3, comm=None)
    want = "key 'data.test': its samples of shape [1, 10, 10] give layer 'fc'"
    with pytest.raises(ConfigError, match=re.escape(want)):
        ServerRank(make_job(cfg), world)
    cfg["data"]["test"]["shape"] = [1, 8, 8]  # the train shape: the server starts
    ServerRank(make_job(cfg), world)
