"""``generate [CONFIG] --weights W --prompt TEXT --tokens N``: sample a
continuation from a language model trained on a ``text`` source, as
nanoGPT's ``sample.py``.

The config may be left out: a checkpoint (or a run folder's ``latest.h5``)
holds the resolved config it was trained with (docs/formats.md). Only the
weights file is read: the vocabulary of byte-level text is fixed (the 256
byte values), and a run on subword tokens (``data text --tokenizer`` or
``--bpe-vocab``) kept its vocabulary's JSON in the checkpoint
(``/tokenizer``, data/tokenizer.py), so the training data file is never
needed. A weights file without one is byte-level. Non-finite weights exit
3 naming the blob (as ``test`` and ``--init``), and so do scores that are
not finite (finite weights whose forward pass overflows: no token is drawn
from a NaN); ``device: D >= 0`` runs on
that GPU, and is refused (exit 2) where there is none, as ``train`` refuses
it.

The test phase of the config's net (no dropout) runs on one sequence of the
data spec's ``sequence_length`` T (``data.test``, else ``data.train``). The
context is the tokens of the prompt (its UTF-8 bytes, or its ids in the
vocabulary), then every token drawn so far, cropped to its last T (nanoGPT's rule); it fills the first positions of the
input and the rest are zeros, which the causal attention never lets the
earlier positions see, so the scores at the context's last position are
the model's prediction of the next token. Each token is drawn from

    softmax(logits / temperature), restricted to the top_k largest logits,
    then to the nucleus of probability top_p

(``temperature`` 0: the largest logit, greedy; the nucleus, as Hugging
Face's top-p after its top-k: the fewest tokens, by descending probability
of the distribution restricted to the top k, a tie taken by the lower id,
whose summed probability reaches top_p, renormalized; top_p 1: every
token), with NumPy's PCG64 seeded by
``seed``: the same seed, weights and prompt give the same text. Only the
vocabulary's ids are drawn (256 for bytes): the rows a net pads its
vocabulary with (GPT-2's 50,257 to 50,304) never are. Each drawn token is
fed back to the embedding that reads the tokens: a net whose embedding has
fewer rows than the ids drawn (an untied output layer scoring more tokens)
is refused at start-up (exit 2, ``_check_tables``), not drawn from a
restricted distribution, which would not be the model's; the prompt's ids
are checked against the same rows.

``write_stream`` prints the prompt (unless ``--no-prompt``), then each token
as it is drawn (flushed), its bytes decoded as UTF-8 by an incremental
decoder: a character whose bytes span several tokens is printed once whole,
an invalid byte sequence as U+FFFD (a vocabulary's ids through its own
decoder, incrementally in the same way: ``Vocabulary.stream``); a newline
ends the text, also when Ctrl-C stops it (exit 130, the tokens drawn
already shown).
"""
import codecs
import os
import sys

import numpy as np

from ..base.errors import ConfigError, UserError


def check_args(tokens, temperature, top_k, seed, prompt, top_p=None):
    """UserError naming the first bad argument."""
    if tokens is None or tokens < 1:
        raise UserError(f"generate: --tokens must be a positive integer, got {tokens}")
    if not np.isfinite(temperature) or temperature < 0:
        raise UserError(f"generate: --temperature must be a finite number >= 0 (0: greedy), "
                        f"got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"generate: --top-k must be a positive integer, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:  # NaN too
        raise UserError(f"generate: --top-p must be a number in (0, 1] (1: every token), "
                        f"got {top_p}")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise UserError(f"generate: --seed must be an integer in [0, 2^63), got {seed}")
    if not prompt:
        raise UserError("generate: --prompt must hold at least one character (e.g. a newline)")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # the bytes of a non-UTF-8 argument: surrogate escapes
        raw = os.fsencode(prompt[e.start:e.end])
        raise UserError(f"generate: --prompt is not UTF-8 text (byte 0x{raw[0]:02x} at "
                        f"character {e.start + 1}); give the prompt as UTF-8") from None


def text_spec(job):
    """The data spec generate reads the sequence length from: data.test,
    else data.train; it must be a text source."""
    for phase in ("test", "train"):
        spec = job.data.get(phase)
        if spec is not None:
            if spec.source != "text":
                raise ConfigError(job.path, f"data.{phase}.source", f"generate needs a "
                                  f"language model trained on source text, got {spec.source}")
            return spec
    raise ConfigError(job.path, "data", "generate needs a data.train or data.test spec "
                      "with source text (its sequence_length is the context)")


class Generator:
    """The test-phase net of ``job`` on one sequence, with ``weights`` loaded."""

    def __init__(self, job, weights):
        from ..graph import Graph
        from ..job.checkpoint_check import check_finite
        from ..job.checkpoint_file import load_params
        from ..job.replica import init_params
        from ..layers import build_net
        from ..parallel.placement import configure_device
        from ..runtime.dispatcher import SerialDispatcher
        from ..runtime.factory import make_dispatcher
        from .predict import default_blob
        spec = text_spec(job)
        self.length = int(spec.sequence_length)
        g = Graph(job.name)
        g.add_blob("data", (1, self.length), "int32")
        g.add_blob("label", (1, self.length), "int32")
        build_net(job.net or (), "test", (g, job.path, job.net_keys))
        for op in g.ops.values():
            if op.op_type.startswith("Attention") and not op.attrs.get("causal", True):
                raise UserError(f"{job.path}: layer '{op.name.split('.')[0]}' is not causal "
                                "attention: generate predicts each token from the ones "
                                "before it only")
        self.logits = default_blob(g)
        shape = g.blobs[self.logits].shape
        if shape is None or len(shape) != 3 or tuple(shape[:2]) != (1, self.length):
            raise UserError(f"{job.path}: the loss reads '{self.logits}' of shape "
                            f"{list(shape or ())}; generate needs token scores (N, T, vocab): "
                            "a softmax_loss with axis: -1")
        self.vocab = int(shape[2])
        self.vocabulary = _vocabulary(weights, self.vocab)  # None: byte-level
        # the ids drawn: the vocabulary's (256 for bytes), not the rows a net pads it with
        self.drawn = min(self.vocab, 256 if self.vocabulary is None else self.vocabulary.size)
        self.rows = _check_tables(job, g, self.logits, self.drawn)
        self.graph = g.prune([self.logits])
        params = [b.name for b in self.graph.params()]
        # device: D >= 0 places the net on a GPU; refused where there is none
        self.device = configure_device(job, self.graph, train=False)
        loaded = load_params(weights)
        wanted = init_params(loaded, params, job, weights)
        check_finite({p: loaded[p] for p in wanted}, weights)  # exit 3 naming the blob
        self.dispatcher = SerialDispatcher(self.graph) if self.device < 0 else \
            make_dispatcher(self.graph, cuda_graph=False)
        for p in wanted:
            value = np.asarray(loaded[p], dtype=np.float32)
            if value.shape != tuple(self.graph.blobs[p].shape):
                raise UserError(f"weights file '{weights}': '{p}' has shape "
                                f"{list(value.shape)}, the net expects "
                                f"{list(self.graph.blobs[p].shape)}")
            self.dispatcher.workspace.set(p, value)

    def next_scores(self, context):
        """float64 (vocab,) logits of the token after ``context`` (its last T)."""
        from ..base.backend import to_numpy
        context = context[-self.length:]
        x = np.zeros((1, self.length), np.int32)
        x[0, :len(context)] = context
        self.dispatcher.workspace.set("data", x)
        self.dispatcher.run()
        out = to_numpy(self.dispatcher.workspace[self.logits])
        return np.asarray(out[0, len(context) - 1], dtype=np.float64)

    def encode(self, prompt):
        """The prompt's tokens: its UTF-8 bytes, or its ids in the vocabulary."""
        if self.vocabulary is None:
            return list(prompt.encode("utf-8"))
        return self.vocabulary.encode(prompt)

    def generate(self, prompt, tokens, temperature=1.0, top_k=None, seed=0, top_p=None):
        """The ``tokens`` token ids drawn after the tokens of ``prompt``,
        yielded one by one as they are drawn."""
        context = self.encode(prompt)
        if not context:
            raise UserError(f"generate: --prompt {prompt!r} encodes to no token of the "
                            "vocabulary; give a longer prompt")
        limit = self.vocab if self.rows is None else self.rows  # what the embedding reads
        if max(context) >= limit:
            what = "byte" if self.vocabulary is None else "token"
            raise UserError(f"generate: --prompt holds {what} {max(context)}, outside the "
                            f"model's vocabulary of {limit} tokens")
        return self._draw(context, tokens, temperature, top_k, np.random.default_rng(seed), top_p)

    def _draw(self, context, tokens, temperature, top_k, rng, top_p=None):
        drawn = 0
        for _ in range(tokens):
            scores = self.next_scores(context)[:self.drawn]
            if not np.isfinite(scores).all():
                # finite weights whose forward pass overflowed: a NaN is no
                # score (the greedy argmax took the first NaN's id, a draw
                # stopped with NumPy's 'Probabilities contain NaN')
                from ..job.checkpoint_check import NonFiniteWeights
                raise NonFiniteWeights(
                    f"generate: the model's scores of the token after the prompt and {drawn} "
                    f"drawn token(s) are not finite ({int(np.isnan(scores).sum())} NaN, "
                    f"{int(np.isinf(scores).sum())} inf of {len(scores)}) although the weights "
                    "are: the forward pass overflowed; no token is drawn from them")
            token = pick(scores, temperature, top_k, rng, top_p)
            context.append(token)
            drawn += 1
            yield token


def _check_tables(job, graph, logits, drawn):
    """The fewest rows of the embeddings that read the tokens (None: no
    embedding does). Each token drawn (an id below ``drawn``) is fed back
    to them, so fewer rows (an output layer not tied to the embedding,
    scoring more tokens than it reads) is a ConfigError naming the
    embedding's ``input_dim`` and the output's ``num_output``, at start-up:
    a drawn id beyond the table would stop the CPU run midway and read a
    wrapped row on a GPU (ops/embedding.py)."""
    from ..job.replica import layer_where, token_tables
    tables = token_tables(graph, "data")
    if not tables:
        return None
    op, rows = min(tables, key=lambda table: table[1])
    if rows >= drawn:
        return rows
    where, layer = layer_where(job, op)
    heads = graph.producers().get(logits) or [op]
    head = next((p for p in heads if p.op_type == "InnerProduct"), heads[0])
    head_where, head_layer = layer_where(job, head)
    scores = graph.blobs[logits].shape[-1]
    raise ConfigError(job.path, f"{where}.input_dim",
                      f"layer '{layer}' reads token ids below {rows}, but layer '{head_layer}' "
                      f"scores {scores} tokens ({head_where}.num_output) and generate feeds "
                      f"each token it draws (ids below {drawn}) back into '{layer}': the net "
                      f"needs input_dim >= {drawn} (or num_output <= {rows}, or the output "
                      "tied to the embedding, tie_weight)")


def _vocabulary(weights, rows):
    """The ``Vocabulary`` the weights file keeps (None: byte-level); its
    ids must fit the net's ``rows`` token scores."""
    from ..data.tokenizer import Vocabulary
    from ..job.checkpoint_file import saved_tokenizer
    text = saved_tokenizer(weights)
    if text is None:
        return None
    vocab = Vocabulary(text, f"generate --weights {weights} (a checkpoint holding a "
                             "tokenizer's vocabulary)", where=f"weights file '{weights}': "
                       "its '/tokenizer'")
    if vocab.size > rows:
        raise UserError(f"weights file '{weights}' holds a vocabulary of {vocab.size} tokens, "
                        f"but the net scores {rows}: give the config it was trained with")
    return vocab


def pick(scores, temperature, top_k, rng, top_p=None):
    """One token id from float64 ``scores`` (see the module docstring)."""
    if temperature == 0:
        return int(np.argmax(scores))
    p = distribution(scores, temperature, top_k, top_p)
    return int(rng.choice(len(p), p=p))


def distribution(scores, temperature, top_k=None, top_p=None):
    """The float64 probabilities ``pick`` draws a token with at a
    temperature > 0 (see the module docstring)."""
    # shifted first: the largest is 0, so a tiny temperature tends to greedy
    # (its quotient -inf elsewhere) instead of overflowing to inf - inf = NaN
    with np.errstate(over="ignore"):
        scores = (scores - scores.max()) / temperature
    if top_k is not None and top_k < len(scores):
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    p = np.exp(scores - scores.max())
    p /= p.sum()
    if top_p is not None and top_p < 1:
        order = np.argsort(-scores, kind="stable")  # descending, a tie by the lower id
        # the first place where the sum reaches top_p (past the end when rounding
        # keeps the whole sum below it: every token)
        keep = order[:np.searchsorted(np.cumsum(p[order]), top_p) + 1]
        nucleus = np.zeros_like(p)
        nucleus[keep] = p[keep]
        p = nucleus / nucleus.sum()
    return p


def write_stream(tokens, prompt="", out=None, vocabulary=None):
    """Print ``prompt``, then the tokens of the iterable ``tokens`` as text
    as they come (bytes as UTF-8, or ids through ``vocabulary``'s decoder),
    flushed each time (see the module docstring); a newline ends the text,
    also when the iteration is interrupted."""
    out = out or sys.stdout
    if vocabulary is None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def step(token):
            return decoder.decode(bytes((token,)))

        def flush():
            return decoder.decode(b"", final=True)
    else:
        stream = vocabulary.stream()
        step, flush = stream.step, stream.flush
    out.write(prompt)
    out.flush()
    try:
        for token in tokens:
            text = step(token)
            if text:
                out.write(text)
                out.flush()
    finally:  # Ctrl-C too: what was drawn stays shown, on a line of its own
        out.write(flush() + "\n")
        out.flush()


def generate_text(job, weights, prompt, tokens, temperature=1.0, top_k=None, show_prompt=True,
                  log=None, top_p=None):
    """``generate``: print the prompt (``show_prompt``) and its continuation
    as it is drawn, with the job's seed (``--seed`` sets it); ``log`` gets
    the notes (the GPU variables a run on the CPU ignores)."""
    from ..base import env
    check_args(tokens, temperature, top_k, job.seed, prompt, top_p)
    generator = Generator(job, weights)
    note = env.cpu_note() if generator.device < 0 else None
    if note and log:
        log(f"note: {note}")
    write_stream(generator.generate(prompt, tokens, temperature, top_k, job.seed, top_p),
                 prompt if show_prompt else "", vocabulary=generator.vocabulary)
