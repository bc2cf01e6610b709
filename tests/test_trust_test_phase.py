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
