"""Subword token data (issue 45 item 4): ``data text --bpe-vocab N`` trains a
byte-level BPE on the user's text, ``--tokenizer FILE`` encodes with a
Hugging Face tokenizer.json; the file keeps the vocabulary's JSON, a run's
checkpoints carry it, and ``generate`` encodes its prompt and decodes its
tokens with it. The text is the standard library's email package, read from
the running Python's own lib folder (nothing is downloaded)."""
import os
import sysconfig

import numpy as np
import pytest

from tests.conftest import run_cli_args, run_cli_here, train_here, write_config_file
from tests.gpt_oracle import gpt_net

pytest.importorskip("tokenizers")

EMAIL = os.path.join(sysconfig.get_paths()["stdlib"], "email")
T = 16


def _texts():
    """The email package's *.py files, sorted by relative path (data text's order)."""
    files = sorted(os.path.relpath(os.path.join(r, n), EMAIL).replace(os.sep, "/")
                   for r, _, names in os.walk(EMAIL) for n in names if n.endswith(".py"))
    return [open(os.path.join(EMAIL, f), encoding="utf-8").read() for f in files]


@pytest.fixture(scope="module")
def bpe_h5(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "email_bpe.h5"
    res = run_cli_here("data", "text", "--from", EMAIL, "--glob", "*.py", "--bpe-vocab", 512,
                       "--out", path)
    assert res.returncode == 0, res.stderr
    return str(path)


def _read(path):
    import h5py
    with h5py.File(path, "r") as f:
        stream = np.concatenate([f["train/tokens"][...], f["val/tokens"][...]])
        return stream, dict(f.attrs), f["tokenizer"][()].decode(), f["file_tokens"][...]


def test_bpe_file_round_trips_exactly(bpe_h5):
    from purine_mpi.data.tokenizer import Vocabulary
    stream, attrs, json_text, per_file = _read(bpe_h5)
    texts = _texts()
    text = "".join(texts)
    assert sum(len(t) for t in texts) > 200_000  # a few hundred KB of source
    vocab = Vocabulary(json_text)
    assert vocab.size == attrs["vocab_size"] == 512
    assert attrs["tokenizer"] == "bpe" and attrs["bytes"] == len(text.encode())
    assert stream.dtype == np.uint16 and int(stream.max()) < 512
    assert int(stream.max()) >= 256  # merged tokens, not bytes alone
    assert len(stream) < len(text.encode()) / 2  # BPE of 512 halves the stream at least
    assert per_file.sum() == len(stream) == attrs["tokens"]
    assert vocab.decode(stream.tolist()) == text  # the whole stream decodes to the text
    # every byte sequence of UTF-8 text round-trips, unseen characters too
    odd = "naïve 世界 \x00\x7f\t\r\n  \U0001F600 ünïcödé ¬ \\ «»\u200b"
    assert vocab.decode(vocab.encode(odd)) == odd
    # the stream decoder gives the same text id by id, never a broken character
    ids = vocab.encode(odd + texts[0][:2000])
    stream_dec = vocab.stream()
    pieces = [stream_dec.step(i) for i in ids] + [stream_dec.flush()]
    assert "".join(pieces) == odd + texts[0][:2000]
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") > 0  # the emoji's bytes span several tokens: printed once whole


def test_bpe_training_is_deterministic(bpe_h5, tmp_path):
    """The same text and N give the same vocabulary and ids."""
    again = tmp_path / "again.h5"
    res = run_cli_here("data", "text", "--from", EMAIL, "--glob", "*.py", "--bpe-vocab", 512,
                       "--out", again)
    assert res.returncode == 0, res.stderr
    a, b = _read(bpe_h5), _read(again)
    assert a[2] == b[2] and np.array_equal(a[0], b[0]) and a[1]["sha256"] == b[1]["sha256"]


def test_a_tokenizer_file_gives_the_ids_tokenizers_gives(tmp_path):
    """A tokenizer.json saved by ``tokenizers`` itself (here a BPE of 400
    with GPT-2's ByteLevel pieces, trained on other text: the json module)
    encodes each file as the library does."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    folder = os.path.dirname(json.__file__)
    other = [open(os.path.join(folder, n), encoding="utf-8").read()
             for n in sorted(os.listdir(folder)) if n.endswith(".py")]
    tok.train_from_iterator(other, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "email_tok.h5"
    res = run_cli_here("data", "text", "--from", EMAIL, "--glob", "*.py", "--tokenizer", path,
                       "--out", out)
    assert res.returncode == 0, res.stderr
    stream, attrs, json_text, per_file = _read(out)
    lib = Tokenizer.from_file(str(path))
    want = [lib.encode(t).ids for t in _texts()]
    assert per_file.tolist() == [len(w) for w in want]
    assert stream.tolist() == [i for w in want for i in w]
    assert attrs["tokenizer"] == "file" and attrs["vocab_size"] == lib.get_vocab_size() == 400
    assert Tokenizer.from_str(json_text).encode(_texts()[1]).ids == want[1]
    # a file that is not a tokenizer.json: one line, exit 2
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 3}')
    res = run_cli_here("data", "text", "--from", EMAIL, "--glob", "*.py", "--tokenizer", bad,
                       "--out", tmp_path / "x.h5")
    assert res.returncode == 2 and "bad.json" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("option", [["--bpe-vocab", "512"], ["--tokenizer", "tok.json"]])
def test_without_the_extra_exits_2_naming_it(option, tmp_path, monkeypatch, capsys):
    """The import of ``tokenizers`` failing (the extra not installed): one
    line naming the option and ``pip install 'purine_mpi[text]'``."""
    import sys

    from purine_mpi.cli import main
    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    status = main(["data", "text", "--from", EMAIL, "--glob", "*.py", *option,
                   "--out", str(tmp_path / "x.h5")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "pip install 'purine_mpi[text]'" in err and option[0] in err
    assert len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "x.h5")


def _config(d, data, vocab, name="cfg.yaml", max_iter=12, **net_changes):
    net = gpt_net(vocab=vocab, width=32, heads=2, blocks=1, max_length=T, approximate="tanh")
    for layer in net:
        for key, value in net_changes.get(layer["name"], {}).items():
            layer.pop(key) if value is None else layer.__setitem__(key, value)
    spec = {"source": "text", "path": str(data), "split": "train", "batch_size": 8,
            "sequence_length": T}
    return write_config_file(d, {
        "name": "tok", "seed": 5, "net": net,
        "data": {"train": dict(spec, shuffle=True), "test": dict(spec, split="val")},
        "solver": {"type": "adamw", "base_lr": 0.01, "max_iter": max_iter, "display": 0,
                   "weight_decay": 0.0}}, name)


def test_a_gpt_trains_on_bpe_and_generate_decodes_with_it(bpe_h5, tmp_path):
    """A tiny GPT (its vocabulary padded to 520 rows) trains on the BPE
    file; its checkpoints hold the vocabulary, and generate, given the
    checkpoint alone, encodes the prompt and prints the drawn ids decoded
    with it: merged (non-byte) tokens among them, padding rows never."""
    import h5py

    from purine_mpi.data.tokenizer import Vocabulary
    from purine_mpi.job.config import load_job
    from purine_mpi.tools.generate import Generator
    config = _config(tmp_path, bpe_h5, 520)
    run = tmp_path / "run"
    train_here(config, run)  # in this process (conftest.train_here)
    json_text = _read(bpe_h5)[2]
    for ckpt in ("latest.h5", "ckpt_12.h5"):
        with h5py.File(run / ckpt, "r") as f:
            assert f["tokenizer"][()].decode() == json_text
    res = run_cli_here("inspect", run / "latest.h5")  # the checkpoint still reads as one
    assert res.returncode == 0, res.stderr
    prompt, args = "def get_", ("--tokens", "40", "--temperature", "1.5", "--seed", "2")
    res = run_cli_here("generate", "--weights", run, "--prompt", prompt, *args)
    assert res.returncode == 0, res.stderr
    # the same draw in process: the ids, and the text they decode to
    vocab = Vocabulary(json_text)
    gen = Generator(load_job(config), str(run / "latest.h5"))
    assert gen.encode(prompt) == vocab.encode(prompt) and len(gen.encode(prompt)) < len(prompt)
    ids = list(gen.generate(prompt, 40, 1.5, None, 2))
    assert len(ids) == 40 and max(ids) < 512  # the padding rows 512..519 are never drawn
    assert any(i >= 256 for i in ids)  # merged tokens, printed as their text
    assert res.stdout == prompt + vocab.decode(ids) + "\n"
    assert len(res.stdout) - len(prompt) - 1 > 40  # more characters than tokens


def test_a_net_smaller_than_the_vocabulary_exits_2(bpe_h5, tmp_path):
    """The embedding, or the scores of an untied lm_head, fewer than the
    file's 512 tokens: exit 2 naming the key and 512."""
    res = run_cli_args("train", _config(tmp_path, bpe_h5, 256), "--out", tmp_path / "r1")
    assert res.returncode == 2, res.stderr
    assert "net[0].input_dim" in res.stderr and "512" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    config = _config(tmp_path, bpe_h5, 512, name="untied.yaml",
                     lm_head={"tie_weight": None, "num_output": 300})
    res = run_cli_args("train", config, "--out", tmp_path / "r2")
    assert res.returncode == 2, res.stderr
    last = len(gpt_net(blocks=1)) - 2  # lm_head: before the loss
    assert f"net[{last}].num_output" in res.stderr and "512" in res.stderr, res.stderr


def test_train_and_test_files_must_share_the_vocabulary(bpe_h5, email_h5, tmp_path):
    """A byte-level test file beside a BPE train file: exit 2 naming both."""
    import yaml
    config = _config(tmp_path, bpe_h5, 512)
    cfg = yaml.safe_load(open(config))
    cfg["data"]["test"]["path"] = email_h5
    res = run_cli_args("train", write_config_file(tmp_path, cfg, "mixed.yaml"),
                       "--out", tmp_path / "r")
    assert res.returncode == 2, res.stderr
    assert os.path.basename(email_h5) in res.stderr and "email_bpe.h5" in res.stderr, res.stderr


def test_a_prompt_character_the_tokenizer_drops_exits_2():
    """A BPE without byte fallback nor unknown token drops a character it
    has no token for: generate continued from 'helloworld' as if the prompt
    were that. Now a UserError names the character; whitespace a
    pre-tokenizer splits on is the tokenizer's own rule, and a byte-level
    vocabulary encodes every character."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from purine_mpi.base.errors import UserError
    from purine_mpi.data.tokenizer import Vocabulary, train_bpe
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world abc"] * 10, trainers.BpeTrainer(vocab_size=40))
    vocab = Vocabulary(tok.to_str())
    assert vocab.encode("hello  world\n") == vocab.encode("hello world")
    with pytest.raises(UserError) as info:
        vocab.encode("hello é world")
    assert "--prompt character 'é' (U+00E9, character 7)" in str(info.value)
    byte_level = Vocabulary(train_bpe(["héllo wörld 日本"] * 20, 300).to_str())
    text = "日本 zzz 🙂 \x00é"
    assert byte_level.decode(byte_level.encode(text)) == text


def test_text_characters_the_tokenizer_drops_are_counted_or_refused(tmp_path):
    """``data text --tokenizer`` with a vocabulary that has no token for 'é'
    (a BPE without byte fallback nor unknown token) left it out of the
    stream without a word. Now a note counts the dropped characters (the
    file records the count), and more than 1% of the text dropped exits 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world abc"] * 10, trainers.BpeTrainer(vocab_size=40))
    path = tmp_path / "tok.json"
    tok.save(str(path))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world abc\n" * 200)
    (src / "b.txt").write_text("hello é world\n" + "abc hello\n" * 100 + "é é\n")
    out = tmp_path / "few.h5"
    res = run_cli_here("data", "text", "--from", src, "--tokenizer", path, "--out", out)
    assert res.returncode == 0, res.stderr
    chars = 16 * 200 + len("hello é world\n" + "abc hello\n" * 100 + "é é\n")
    assert (f"note: the tokenizer drops 3 of the {chars:,} characters of the text (1 distinct; "
            "no token covers them): 'é' (U+00E9) x3, first in b.txt, character 7") \
        in res.stderr, res.stderr
    import h5py
    with h5py.File(out, "r") as f:
        assert f.attrs["dropped_characters"] == 3
        n = len(f["train/tokens"]) + len(f["val/tokens"])
    assert n == sum(len(tok.encode(t).ids) for t in
                    [(src / "a.txt").read_text(), (src / "b.txt").read_text()])
    # a tokenizer that drops more than 1% of the text: exit 2, one line, no file
    (src / "c.txt").write_text("日本語 " * 100)
    res = run_cli_here("data", "text", "--from", src, "--tokenizer", path,
                       "--out", tmp_path / "many.h5")
    assert res.returncode == 2, res.stderr
    assert "drops 303 of the" in res.stderr and "more than 1% of the text" in res.stderr, \
        res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "many.h5").exists()


def test_text_characters_encoded_as_the_unknown_token_are_counted(tmp_path):
    """A vocabulary with an unknown token encodes 'é' as '[UNK]', which
    decodes to none of it: the text was lost as silently as a dropped one.
    Now the note counts those characters too (the file records
    unknown_characters), and they count towards the 1% refusal."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world abc"] * 10,
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tok.json"
    tok.save(str(path))
    src = tmp_path / "a.txt"
    src.write_text("hello world abc\n" * 300 + "hello éé world\n")
    out = tmp_path / "unk.h5"
    res = run_cli_here("data", "text", "--from", src, "--tokenizer", path, "--out", out)
    assert res.returncode == 0, res.stderr
    assert ("note: the tokenizer encodes 2 of the 4,815 characters of the text as its unknown "
            "token '[UNK]' (1 distinct): 'é' (U+00E9) x2, first in a.txt, character 4807") \
        in res.stderr, res.stderr
    import h5py
    with h5py.File(out, "r") as f:
        assert (f.attrs["unknown_characters"], f.attrs["dropped_characters"]) == (2, 0)
    src.write_text("hello world abc\n" * 30 + "zzz qqq\n" * 10)
    res = run_cli_here("data", "text", "--from", src, "--tokenizer", path,
                       "--out", tmp_path / "many.h5")
    assert res.returncode == 2 and "as its unknown token '[UNK]'" in res.stderr, res.stderr


def test_dropped_characters_is_the_per_character_reference():
    """``dropped_characters`` walks the gaps between the tokens' spans: the
    indices a per-character coverage table gives (spans overlapping, out of
    order, empty; whitespace left out), on random cases."""
    import random
    from purine_mpi.data.tokenizer import dropped_characters

    def reference(text, offsets):
        covered = [False] * len(text)
        for a, b in offsets:
            covered[a:b] = [True] * (b - a)
        return [i for i, c in enumerate(text) if not covered[i] and not c.isspace()]

    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(0, 30)
        text = "".join(rng.choice("ab é\n") for _ in range(n))
        offsets = [tuple(sorted((rng.randint(0, n), rng.randint(0, n))))
                   for _ in range(rng.randint(0, 8))]
        assert dropped_characters(text, offsets) == reference(text, offsets), (text, offsets)


def test_a_tokenizer_json_s_truncation_and_padding_are_not_applied(tmp_path):
    """A tokenizer.json may carry truncation and padding (a model's
    tokenizer saved for its fixed-length inputs). ``data text`` applied
    them: truncation cut each file to ``max_length`` tokens (here 10 tokens
    short of the file: 0.2% of the text, so only a note, calling the cut
    characters ones "no token covers"), padding put pad ids into the
    stream (6,650 tokens of text became 20,000), and the stored JSON
    carried them into every checkpoint, so ``generate`` padded its prompt
    (9 characters, 20,000 tokens: the context it continued was pads). Now
    the stream is the library's encoding of the whole text, a note says
    what was not applied, and the stored JSON has neither."""
    import json

    from tokenizers import Tokenizer
    from purine_mpi.data.tokenizer import Vocabulary, train_bpe
    text = "".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(400))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(text)
    tok = train_bpe([text], 300)
    plain = tok.encode(text, add_special_tokens=False).ids
    # the whole text's tokens, the reference (6,650 with tokenizers 0.23: the count
    # of a trained BPE is the library version's; the padding below must exceed it)
    assert 1000 < len(plain) < 20000
    tok.enable_truncation(max_length=len(plain) - 10)
    tok.save(str(tmp_path / "cut.json"))
    tok.no_truncation()
    tok.enable_padding(length=20000, pad_id=0, pad_token="!")
    tok.save(str(tmp_path / "pad.json"))
    said = {"cut": f"asks for truncation to {len(plain) - 10} tokens; not applied",
            "pad": "asks for padding with '!' (id 0) to 20000 tokens; not applied"}
    import h5py
    for name, words in said.items():
        out = tmp_path / f"{name}.h5"
        res = run_cli_here("data", "text", "--from", src, "--tokenizer",
                           tmp_path / f"{name}.json", "--out", out)
        assert res.returncode == 0, res.stderr
        assert words in res.stderr and "drops" not in res.stderr, res.stderr
        with h5py.File(out, "r") as f:
            stream = np.concatenate([f["train/tokens"][...], f["val/tokens"][...]])
            stored = f["tokenizer"][()].decode()
            assert f.attrs["dropped_characters"] == 0
        assert stream.tolist() == plain, f"{name}: {len(stream)} tokens, the text has {len(plain)}"
        spec = json.loads(stored)
        assert spec["truncation"] is None and spec["padding"] is None
        assert Tokenizer.from_str(stored).encode(text).ids == plain
    # a checkpoint written before the fix holds the padding: generate's prompt is not padded
    vocab = Vocabulary((tmp_path / "pad.json").read_text())
    tok.no_padding()
    assert vocab.encode("def f(x):") == tok.encode("def f(x):").ids  # 5 ids, not 20,000
