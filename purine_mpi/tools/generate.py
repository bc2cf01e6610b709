"""``generate CONFIG --weights W --prompt TEXT --tokens N``: sample a
continuation from a language model trained on a ``text`` source.

The test phase of the config's net (no dropout) runs on one sequence of the
data spec's ``sequence_length`` T (``data.test``, else ``data.train``). The
context is the byte tokens of the prompt, then of every token drawn so far,
cropped to its last T (nanoGPT's rule); it fills the first positions of the
input and the rest are zeros, which the causal attention never lets the
earlier positions see, so the scores at the context's last position are
the model's prediction of the next token. Each token is drawn from

    softmax(logits / temperature), restricted to the top_k largest logits

(``temperature`` 0: the largest logit, greedy), with NumPy's PCG64 seeded by
``seed``: the same seed, weights and prompt give the same text. The
continuation (its bytes decoded as UTF-8, an incomplete or invalid byte
sequence shown as U+FFFD) is the result.
"""
import numpy as np

from ..base.errors import UserError


def check_args(tokens, temperature, top_k, seed, prompt):
    """UserError naming the first bad argument."""
    if tokens is None or tokens < 1:
        raise UserError(f"generate: --tokens must be a positive integer, got {tokens}")
    if not np.isfinite(temperature) or temperature < 0:
        raise UserError(f"generate: --temperature must be a finite number >= 0 (0: greedy), "
                        f"got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"generate: --top-k must be a positive integer, got {top_k}")
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise UserError(f"generate: --seed must be an integer in [0, 2^63), got {seed}")
    if not prompt:
        raise UserError("generate: --prompt must hold at least one character (e.g. a newline)")


def text_spec(job):
    """The data spec generate reads the sequence length from: data.test,
    else data.train; it must be a text source."""
    for phase in ("test", "train"):
        spec = job.data.get(phase)
        if spec is not None:
            if spec.source != "text":
                raise UserError(f"{job.path}: key 'data.{phase}.source': generate needs a "
                                f"language model trained on source text, got {spec.source}")
            return spec
    raise UserError(f"{job.path}: key 'data': generate needs a data.train or data.test spec "
                    "with source text (its sequence_length is the context)")


class Generator:
    """The test-phase net of ``job`` on one sequence, with ``weights`` loaded."""

    def __init__(self, job, weights):
        from ..graph import Graph
        from ..job.checkpoint_file import load_params
        from ..job.replica import init_params
        from ..layers import build_net
        from ..runtime.dispatcher import SerialDispatcher
        from .predict import default_blob
        spec = text_spec(job)
        self.length = int(spec.sequence_length)
        g = Graph(job.name)
        g.add_blob("data", (1, self.length), "int32")
        g.add_blob("label", (1, self.length), "int32")
        build_net(job.net or (), "test", (g, job.path))
        g.infer_shapes()
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
        self.graph = g.prune([self.logits])
        loaded = load_params(weights)
        params = [b.name for b in self.graph.params()]
        self.dispatcher = SerialDispatcher(self.graph)
        for p in init_params(loaded, params, job, weights):
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

    def generate(self, prompt, tokens, temperature=1.0, top_k=None, seed=0):
        """The ``tokens`` token ids drawn after the bytes of ``prompt``."""
        context = list(prompt.encode("utf-8"))
        if max(context) >= self.vocab:
            raise UserError(f"generate: --prompt holds byte {max(context)}, outside the "
                            f"model's vocabulary of {self.vocab} tokens")
        rng = np.random.default_rng(seed)
        drawn = []
        for _ in range(tokens):
            token = pick(self.next_scores(context)[:256], temperature, top_k, rng)  # bytes
            drawn.append(token)
            context.append(token)
        return drawn


def pick(scores, temperature, top_k, rng):
    """One token id from float64 ``scores`` (see the module docstring)."""
    if temperature == 0:
        return int(np.argmax(scores))
    scores = scores / temperature
    if top_k is not None and top_k < len(scores):
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    p = np.exp(scores - scores.max())
    p /= p.sum()
    return int(rng.choice(len(p), p=p))


def generate_text(job, weights, prompt, tokens, temperature=1.0, top_k=None):
    """``generate``: the continuation of ``prompt`` as text, drawn with the
    job's seed (``--seed`` sets it)."""
    check_args(tokens, temperature, top_k, job.seed, prompt)
    drawn = Generator(job, weights).generate(prompt, tokens, temperature, top_k, job.seed)
    return bytes(drawn).decode("utf-8", errors="replace")
