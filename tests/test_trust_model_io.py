"""Where a model enters or leaves a run: vocabularies (docs/transformers.md,
"Tokenizers"; docs/formats.md, "/tokenizer") and a run's own files.

- a text data file whose ``/tokenizer`` is damaged (not a tokenizer's JSON,
  or not its sha256) stops ``train`` at start-up with one line, exit 2; it
  trained to its first checkpoint and then failed there (exit 1, no
  checkpoint: the iterations lost);
- a checkpoint whose ``/tokenizer`` is damaged: ``generate`` exits 2 with one
  line (it ended in the tokenizers library's traceback, exit 1);
- ``data text --bpe-vocab N`` beyond 2**24: exit 2 (10**11 aborted the process
  in the library's allocation, exit 134), and N beyond what the text can
  merge trains the same vocabulary without allocating for N;
- weights trained on another vocabulary than the job's text data (another
  BPE of the same size, or bytes against a BPE of 256): ``test --weights``,
  ``--init`` and ``--resume`` exit 2 (they ran on, each id read as another
  token's row: a test loss of scrambled tokens reported as the model's);
  ``--init-skip`` of the embedding fine-tunes on the new vocabulary;
- an ``--out`` that is a file of a run (its metrics.jsonl, train.log,
  config.yaml, memory.json): ``export onnx``, ``convert caffe``, ``data``
  and ``predict --force`` exit 2 and leave it as it was (they replaced it:
  the run's record gone, "wrote runs/x/metrics.jsonl", exit 0).
"""
import hashlib
import os
import sysconfig

import h5py
import pytest

from tests.conftest import FakeWorld, run_cli_args, train_here, write_config_file
from tests.gpt_oracle import gpt_net

T = 8
LIB = sysconfig.get_paths()["stdlib"]


def _text_file(tmp_path, package, name, bpe=300):
    from purine_mpi.data.text import write_text
    out = tmp_path / name
    write_text(os.path.join(LIB, package), str(out), glob="_*.py", val_fraction=0.2,
               bpe_vocab=bpe)
    return str(out)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("vocab")
    return {"a": _text_file(d, "email", "a.h5"), "b": _text_file(d, "json", "b.h5"),
            "b256": _text_file(d, "json", "b256.h5", bpe=256),
            "bytes": _text_file(d, "json", "bytes.h5", bpe=None)}


def _config(d, data, vocab=300, name="cfg.yaml", iters=2):
    net = gpt_net(vocab=vocab, width=16, heads=2, blocks=1, max_length=T)
    spec = {"source": "text", "path": str(data), "split": "train", "batch_size": 2,
            "sequence_length": T}
    return write_config_file(d, {
        "name": "v", "seed": 3, "net": net,
        "data": {"train": dict(spec, shuffle=True), "test": dict(spec, split="val")},
        "solver": {"type": "adamw", "base_lr": 0.01, "max_iter": iters, "display": 0,
                   "test_iter": 1, "test_interval": 0}}, name)


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    """A run on BPE file a and one on bytes, 2 iterations each."""
    d = tmp_path_factory.mktemp("runs")
    return {"a": str(train_here(_config(d, files["a"], name="a.yaml"), d / "a")),
            "bytes": str(train_here(_config(d, files["bytes"], 256, name="y.yaml"),
                                    d / "y"))}


def _replace_tokenizer(path, text, sha=True):
    with h5py.File(path, "r+") as f:
        del f["tokenizer"]
        ds = f.create_dataset("tokenizer", data=text, dtype=h5py.string_dtype("utf-8"))
        ds.attrs["sha256"] = hashlib.sha256(text.encode()).hexdigest() if sha else "0" * 64
        ds.attrs["vocab_size"] = 300


def _one_line(res, rc=2):
    assert res.returncode == rc, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
        res.stderr
    return res.stderr


@pytest.mark.parametrize("damage", ["not json", '{"a": 1}', "sha"])
def test_a_damaged_data_tokenizer_stops_train_at_start_up(files, tmp_path, damage):
    import shutil

    from purine_mpi.base.errors import UserError
    from purine_mpi.data.text import shared_vocabulary
    data = str(tmp_path / "damaged.h5")
    shutil.copy(files["a"], data)
    if damage == "sha":
        with h5py.File(data, "r") as f:
            text = f["tokenizer"][()].decode()
        _replace_tokenizer(data, text.replace('"a"', '"b"', 1), sha=False)
    else:
        _replace_tokenizer(data, damage)
    with pytest.raises(UserError, match="damaged.h5.*/tokenizer"):
        shared_vocabulary([("data.train.path", data)])
    if damage == "not json":  # the command: one line before any iteration, no files
        out = tmp_path / "run"
        err = _one_line(run_cli_args("train", _config(tmp_path, data), "--out", out))
        assert "damaged.h5" in err and "/tokenizer" in err and "JSON" in err, err
        assert not any(n.endswith(".h5") for n in os.listdir(out)) if out.exists() else True


def test_generate_with_a_damaged_checkpoint_tokenizer_exits_2(runs, tmp_path):
    import shutil
    ckpt = str(tmp_path / "ck.h5")
    shutil.copy(os.path.join(runs["a"], "latest.h5"), ckpt)
    _replace_tokenizer(ckpt, "not json")
    err = _one_line(run_cli_args("generate", "--weights", ckpt, "--prompt", "def ",
                                 "--tokens", "2"))
    assert "ck.h5" in err and "/tokenizer" in err, err
    # a JSON other than its sha256 attribute digests: edited
    shutil.copy(os.path.join(runs["a"], "latest.h5"), ckpt)
    with h5py.File(ckpt, "r") as f:
        text = f["tokenizer"][()].decode()
    _replace_tokenizer(ckpt, text.replace('"a"', '"b"', 1), sha=False)
    err = _one_line(run_cli_args("generate", "--weights", ckpt, "--prompt", "def ",
                                 "--tokens", "2"))
    assert "ck.h5' is corrupt: '/tokenizer' does not match its sha256" in err, err


def test_bpe_vocab_beyond_the_limit_exits_2_and_a_large_one_is_the_text_s(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    err = _one_line(run_cli_args("data", "text", "--from", os.path.join(LIB, "json"),
                                 "--glob", "__init__.py", "--bpe-vocab", 10 ** 11,
                                 "--out", tmp_path / "x.h5"))
    assert "--bpe-vocab must be at most 16,777,216" in err, err  # docs/transformers.md
    assert not (tmp_path / "x.h5").exists()
    from purine_mpi.data.tokenizer import train_bpe
    # N far beyond the text's pairs: the same vocabulary as the library's own
    texts = ["def f(x): return x + 1  # é ü", "class A: pass"]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=20000, special_tokens=[], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert train_bpe(texts, 20000).to_str() == tok.to_str()


def _trainer(config, out, **kw):
    from purine_mpi.job.config import load_job
    from purine_mpi.train.trainer import Trainer
    return Trainer(load_job(config), str(out), world=FakeWorld(), log=lambda line: None, **kw)


def test_weights_of_another_vocabulary_are_refused(files, runs, tmp_path):
    """Checkpoint a (BPE of 300 on email) against file b (BPE of 300 on
    json): the same shapes, other tokens."""
    from purine_mpi.base.errors import UserError
    other = _config(tmp_path, files["b"], name="b.yaml", iters=4)
    ckpt = os.path.join(runs["a"], "latest.h5")
    err = _one_line(run_cli_args("test", other, "--weights", ckpt))
    assert "latest.h5" in err and "wte/weight" in err and "--init-skip wte" in err, err
    with pytest.raises(UserError, match="vocabulary .* but this job's text data"):
        _trainer(other, tmp_path / "init", init=ckpt)
    with pytest.raises(UserError, match="a resumed run would read each id as another token"):
        _trainer(other, tmp_path / "resume", resume=ckpt).close()
    # the embedding started afresh: a fine-tune on the new vocabulary
    t = _trainer(other, tmp_path / "skip", init=ckpt, init_skip=("wte",))
    t.close()
    # bytes against a BPE of 256 (the same 256 rows, other tokens)
    b256 = _config(tmp_path, files["b256"], 256, name="b256.yaml")
    with pytest.raises(UserError, match="bytes .* but this job's text data holds those of "
                                        "vocabulary"):
        _trainer(b256, tmp_path / "b256", init=os.path.join(runs["bytes"], "latest.h5"))
    # the same vocabulary (its own file) loads, and so does a byte-level one
    _trainer(_config(tmp_path, files["a"], name="a2.yaml"), tmp_path / "same",
             init=ckpt).close()
    _trainer(_config(tmp_path, files["bytes"], 256, name="y2.yaml"), tmp_path / "same_b",
             init=os.path.join(runs["bytes"], "latest.h5")).close()


def test_an_out_that_is_a_run_s_own_file_is_refused(runs, tmp_path):
    """The run folder of ``runs["bytes"]`` as train left it; each command
    aimed at one of its files exits 2 with one line naming the file and the
    run, and the file keeps its bytes; a new name in the folder is written."""
    from tests.conftest import run_cli_here
    run = runs["bytes"]
    (tmp_path / "run").mkdir()
    # a run's folder as train --force tells one: a metrics row of ours
    for name, text in (("metrics.jsonl", '{"phase": "train", "iter": 1}\n'),
                       ("train.log", "log\n"),
                       ("config.yaml", "name: v\n"), ("memory.json", "{}\n")):
        (tmp_path / "run" / name).write_text(text)
    config = os.path.join(os.path.dirname(run), "y.yaml")
    weights = os.path.join(run, "latest.h5")
    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "caffe", "lenet_digits.prototxt")
    folder = str(tmp_path / "run")
    for name, args in (("metrics.jsonl", ("export", "onnx", config, "--weights", weights)),
                       ("config.yaml", ("export", "onnx", config, "--weights", weights)),
                       ("train.log", ("convert", "caffe", fixture, "--data", weights)),
                       ("memory.json", ("data", "text", "--from", os.path.join(LIB, "json"),
                                        "--glob", "__init__.py")),
                       ("metrics.jsonl", ("predict", config, "--weights", weights,
                                          "--force"))):
        out = os.path.join(folder, name)
        before = open(out).read()
        res = run_cli_here(*args, "--out", out)
        err = _one_line(res)
        assert f"is the {name} of the run in {folder}" in err, err
        assert open(out).read() == before
    res = run_cli_here("export", "onnx", config, "--weights", weights, "--out",
                       os.path.join(folder, "model.onnx"))
    assert res.returncode == 0, res.stderr


def test_export_hf_of_a_damaged_checkpoint_tokenizer_writes_nothing(files, tmp_path):
    """export hf copied a checkpoint's ``/tokenizer`` that is not a
    tokenizer's JSON into tokenizer.json and said "wrote" (exit 0):
    AutoTokenizer then fails on the folder. Now exit 2, no folder."""
    from tests.conftest import run_cli_here
    from tests.gpt_nets import gpt_config
    cfg = gpt_config(files["a"], layers=1, width=16, heads=2, length=T, iters=2)
    cfg["net"][0]["input_dim"] = cfg["net"][-2]["num_output"] = 300
    config = write_config_file(tmp_path, cfg, "gpt2.yaml")
    run = train_here(config, tmp_path / "run")
    res = run_cli_here("export", "hf", config, "--weights", run, "--out", tmp_path / "ok")
    assert res.returncode == 0 and (tmp_path / "ok" / "tokenizer.json").exists(), res.stderr
    _replace_tokenizer(os.path.join(run, "latest.h5"), "not json")
    err = _one_line(run_cli_here("export", "hf", config, "--weights", run,
                                 "--out", tmp_path / "hf"))
    assert "latest.h5" in err and "/tokenizer" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("parallel,n", [({"scheme": "pipeline", "stages": 2}, 2),
                                        ({"scheme": "data", "mode": "sync_ps"}, 3)])
def test_another_vocabulary_is_one_verdict_on_every_rank(files, runs, tmp_path, parallel, n):
    """A pipeline's stage 1 holds no embedding, a parameter server reads its
    --init itself: every rank finds the mismatch alike (one line, no
    ``rank R:`` of a rank that alone refused), and --init-skip wte trains."""
    import yaml

    from tests.conftest import run_mpi_cli
    cfg = yaml.safe_load(open(_config(tmp_path, files["b"], name="b.yaml")))
    cfg["parallel"] = parallel
    if parallel.get("mode") == "sync_ps":
        cfg["solver"] = {"type": "sgd", "base_lr": 0.01, "max_iter": 2, "display": 0,
                         "test_interval": 0}
        cfg_a = yaml.safe_load(open(_config(tmp_path, files["a"], name="asgd.yaml")))
        cfg_a["solver"] = dict(cfg["solver"])
        ckpt = str(train_here(write_config_file(tmp_path, cfg_a, "asgd.yaml"), tmp_path / "s2"))
    else:
        ckpt = runs["a"]
    config = write_config_file(tmp_path, cfg, "par.yaml")
    weights = os.path.join(ckpt, "latest.h5")
    res = run_mpi_cli(n, "train", config, "--init", weights, "--out", tmp_path / "r")
    err = _one_line(res)
    assert err.startswith("error: weights file") and "--init-skip wte" in err, err
    res = run_mpi_cli(n, "train", config, "--init", weights, "--init-skip", "wte",
                      "--out", tmp_path / "r2")
    assert res.returncode == 0, res.stderr


def test_a_prompt_encoded_as_the_unknown_token_exits_2():
    """A vocabulary with an unknown token: generate encoded 'hello zzz' as
    'hello [UNK]' and continued that prompt while printing 'hello zzz'.
    Now a UserError names the text; the unknown token typed as itself is
    that token, and a known prompt encodes as before."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from purine_mpi.base.errors import UserError
    from purine_mpi.data.tokenizer import Vocabulary
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world abc"] * 10,
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    vocab = Vocabulary(tok.to_str())
    with pytest.raises(UserError, match=r"--prompt text 'zzz' \(characters 7 to 9\) .* "
                                        r"unknown token '\[UNK\]'"):
        vocab.encode("hello zzz world")
    assert vocab.encode("hello  world") == [tok.token_to_id("hello"), tok.token_to_id("world")]
    assert vocab.encode("hello [UNK]") == [tok.token_to_id("hello"), tok.token_to_id("[UNK]")]


def _as_older_library_wrote_it(text):
    """The JSON tokenizers 0.19 (before 0.20) writes for the vocabulary
    ``text``: its BPE merges as "a b" strings, not ["a", "b"] pairs
    (checked against tokenizers 0.19.1's own ``to_str``), and a Unigram's
    scores as 17 digits the newer library reads back one ulp off."""
    import json
    spec = json.loads(text)
    spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
    return json.dumps(spec, ensure_ascii=False)


def test_the_same_vocabulary_written_by_another_library_version_is_accepted(
        files, runs, tmp_path):
    """A data file made with tokenizers < 0.20 and one remade from the same
    tokenizer.json with a newer library hold the same vocabulary in two
    spellings (the merges as "a b" or ["a", "b"]): the ids are the same,
    so --init, --resume and test of a checkpoint of one on the other load
    (they exited 2, 'trained on the token ids of vocabulary c094cb...,
    but this job's text data holds those of vocabulary bad337...')."""
    import shutil

    import tokenizers

    from purine_mpi.data.tokenizer import vocabulary_digest
    old = str(tmp_path / "a_old.h5")
    shutil.copy(files["a"], old)
    with h5py.File(old, "r") as f:
        text = f["tokenizer"][()].decode()
    older = _as_older_library_wrote_it(text)
    _replace_tokenizer(old, older)
    sample = "def f(x):\n    return x  # é"
    assert tokenizers.Tokenizer.from_str(older).encode(sample).ids == \
        tokenizers.Tokenizer.from_str(text).encode(sample).ids
    assert vocabulary_digest(older) == vocabulary_digest(text)
    config = _config(tmp_path, old, name="old.yaml", iters=4)
    ckpt = os.path.join(runs["a"], "latest.h5")  # trained on the newer spelling
    _trainer(config, tmp_path / "init", init=ckpt).close()
    _trainer(config, tmp_path / "resume", resume=ckpt).close()
    # another vocabulary in the older spelling is still another one
    with h5py.File(files["b"], "r") as f:
        other = f["tokenizer"][()].decode()
    assert vocabulary_digest(_as_older_library_wrote_it(other)) != vocabulary_digest(text)


def test_a_unigram_s_scores_read_back_one_ulp_off_are_the_same_vocabulary():
    """tokenizers 0.19 wrote a Unigram score -7.4070626413948215; 0.23
    reads it and writes -7.407062641394821 (another double, one ulp off):
    the same vocabulary for the digest, another score is not."""
    import json

    from purine_mpi.data.tokenizer import vocabulary_digest

    def unigram(score):
        return json.dumps({"model": {"type": "Unigram", "unk_id": 0,
                                     "vocab": [["<unk>", 0.0], ["a", score]]}})
    assert vocabulary_digest(unigram(-7.4070626413948215)) == \
        vocabulary_digest(unigram(-7.407062641394821))
    assert vocabulary_digest(unigram(-7.4070626413948215)) != \
        vocabulary_digest(unigram(-7.5))


def test_an_out_named_as_a_run_file_in_a_folder_of_no_run_is_written(tmp_path):
    """convert caffe --out lenet/config.yaml, then again after an edit: the
    folder holds that config alone, no run (train --force tells a run by a
    checkpoint, metrics, a log or TensorBoard files of ours, a config alone
    being none), so the second convert replaces it as before (it exited 2,
    '... is the config.yaml of the run in lenet'); beside a run's
    metrics.jsonl the same --out is refused."""
    from tests.conftest import run_cli_here
    res = run_cli_here("data", "digits", "--out", tmp_path / "digits.h5")
    assert res.returncode == 0, res.stderr
    net = os.path.join(os.path.dirname(__file__), "fixtures", "caffe", "lenet_digits.prototxt")
    out = tmp_path / "lenet" / "config.yaml"
    out.parent.mkdir()
    for _ in range(2):
        res = run_cli_here("convert", "caffe", net, "--data", tmp_path / "digits.h5",
                           "--out", out)
        assert res.returncode == 0, res.stderr
    (tmp_path / "lenet" / "metrics.jsonl").write_text(
        '{"phase": "train", "iter": 1, "loss": 2.3}\n')
    before = out.read_text()
    err = _one_line(run_cli_here("convert", "caffe", net, "--data", tmp_path / "digits.h5",
                                 "--out", out))
    assert "is the config.yaml of the run in" in err and out.read_text() == before, err


@pytest.mark.mpi
def test_a_damaged_data_tokenizer_is_one_line_on_every_rank_of_a_ps_run(files, tmp_path):
    """The parameter servers read the text data's vocabulary as the workers'
    graphs do: a damaged /tokenizer stops every rank alike (it printed
    'error: rank 0: ...' and 'error: rank 1: ...', the server alone going on
    to its first exchange)."""
    import shutil

    import yaml

    from tests.conftest import run_mpi_cli
    data = str(tmp_path / "damaged.h5")
    shutil.copy(files["a"], data)
    _replace_tokenizer(data, "not json")
    cfg = yaml.safe_load(open(_config(tmp_path, data)))
    cfg["parallel"] = {"scheme": "data", "mode": "sync_ps"}
    cfg["solver"] = {"type": "sgd", "base_lr": 0.01, "max_iter": 2, "display": 0,
                     "test_interval": 0}
    config = write_config_file(tmp_path, cfg, "ps.yaml")
    err = _one_line(run_mpi_cli(3, "train", config, "--out", tmp_path / "r"))
    assert err.startswith("error: text data file") and "damaged.h5" in err, err


def test_a_unigram_written_by_tokenizers_0_13_is_the_same_vocabulary():
    """tokenizers 0.13 wrote a Metaspace's ``add_prefix_space: true`` where
    0.14 and later write ``prepend_scheme: "always", split: true``, and no
    Unigram ``byte_fallback`` (false): the library reads both as one
    tokenizer, and so does the digest (it told them apart: a data file
    remade after the upgrade refused its run's checkpoints)."""
    tokenizers = pytest.importorskip("tokenizers")
    import json

    from tokenizers import decoders, models, pre_tokenizers, trainers

    from purine_mpi.data.tokenizer import vocabulary_digest
    tok = tokenizers.Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world, a tiny text", "another tiny world"] * 5,
                            trainers.UnigramTrainer(vocab_size=40, special_tokens=["<unk>"],
                                                    unk_token="<unk>", show_progress=False))
    new = tok.to_str()
    spec = json.loads(new)
    for part in ("pre_tokenizer", "decoder"):
        assert spec[part]["prepend_scheme"] == "always" and spec[part]["split"] is True
        del spec[part]["prepend_scheme"], spec[part]["split"]
        spec[part]["add_prefix_space"] = True
    assert spec["model"].pop("byte_fallback") is False
    old = json.dumps(spec, ensure_ascii=False)
    assert tokenizers.Tokenizer.from_str(old).to_str() == new  # one tokenizer
    assert vocabulary_digest(old) == vocabulary_digest(new)
    spec["pre_tokenizer"]["add_prefix_space"] = False  # "never": another one
    assert vocabulary_digest(json.dumps(spec)) != vocabulary_digest(new)
