"""A text data file with tokens no net can read is refused at start-up, one
line naming the file, the token and the layer, exit 2 (session 71's
failure hunt, a corrupt sample in text data):

- a negative token (a file written with a signed dtype) trained silently:
  the embedding read it as a row from the end, the loss as a class (the
  start-up check compared the largest token with the loss's classes only);
- a token inside the loss's classes but past the embedding's rows (an
  untied head with more classes than the table, ``input_dim: 128`` for
  ASCII text) ended the run with exit 1 at the first batch that held it,
  any time into the run, or never, where no batch drew it (measured:
  gpt_tiny untied to 512 classes, token 300 in a byte file, 60 iterations
  under ``mpiexec -n 2``: trained to the end, exit 0);
- float tokens: `rank 0: RuntimeError: Unable to synchronously get
  dataspace (identifier is not of specified type)`, exit 1 (the message
  read the dataset's shape after its file was closed)."""
import h5py
import numpy as np

from .conftest import run_cli_args, write_config_file
from .gpt_nets import gpt_config
from .test_cli import assert_user_error


def _with_token(src, dst, dtype, value, at=100):
    """A copy of the text file ``src`` whose train tokens are of ``dtype``
    with ``value`` at position ``at``."""
    with h5py.File(src, "r") as f, h5py.File(dst, "w") as g:
        f.copy(f["val"], g, "val")
        for key in f:
            if key not in ("train", "val"):
                f.copy(f[key], g, key)
        tokens = f["train/tokens"][()].astype(dtype)
        tokens[at] = value
        g["train/tokens"] = tokens
    return str(dst)


def _train(tmp_path, data, untied=False):
    cfg = gpt_config(data, layers=1, iters=2)
    if untied:  # a head of more classes than the embedding has rows
        head = cfg["net"][-2]
        del head["tie_weight"]
        head["num_output"] = 512
    path = write_config_file(tmp_path, cfg)
    return run_cli_args("train", path, "--out", tmp_path / "run")


def test_a_negative_token_is_refused_at_start_up(text_h5, tmp_path):
    bad = _with_token(text_h5, tmp_path / "neg.h5", np.int16, -3)
    assert_user_error(_train(tmp_path, bad), "neg.h5", "split 'train'", "token -3",
                      "[0, 256)")


def test_a_token_past_the_embeddings_rows_is_refused_at_start_up(text_h5, tmp_path):
    bad = _with_token(text_h5, tmp_path / "wide.h5", np.uint16, 300)
    assert_user_error(_train(tmp_path, bad, untied=True), "wide.h5", "split 'train'",
                      "token 300", "[0, 256)", "'wte'", "net[0].input_dim")


def test_float_tokens_are_one_line(text_h5, tmp_path):
    bad = _with_token(text_h5, tmp_path / "float.h5", np.float32, np.nan)
    assert_user_error(_train(tmp_path, bad), "float.h5", "/train/tokens",
                      "1-D integer tokens", "float32")
