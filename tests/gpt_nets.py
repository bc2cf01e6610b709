"""Tiny GPTs for the parallel-scheme and export tests (issue 37): byte
tokens of a standard-library file (nothing downloaded) and a nanoGPT-shaped
net (pre-norm blocks, tied embedding and head, token-level loss)."""
import json

from purine_mpi.data.text import write_text

#: real text on every machine: the standard library's json package
SOURCE = json.__file__.rsplit("/", 1)[0]


def text_h5(directory):
    """The json package's *.py files as a byte-token file in ``directory``."""
    out = directory / "json_tokens.h5"
    if not out.exists():
        write_text(SOURCE, str(out), glob="*.py", val_fraction=0.2)
    return str(out)


def block(i, width, heads, fused=True):
    """One pre-norm GPT block: ln_1, attention, residual, ln_2, MLP, residual."""
    x, n = ("x0" if i == 0 else f"x{i}"), f"b{i}"
    return [
        {"type": "layer_norm", "name": f"{n}_ln1", "bottom": x, "top": f"{n}_h1"},
        {"type": "attention", "name": f"{n}_attn", "bottom": f"{n}_h1", "top": f"{n}_a",
         "num_heads": heads, "fused": fused},
        {"type": "eltwise", "name": f"{n}_res1", "bottom": [x, f"{n}_a"], "top": f"{n}_r"},
        {"type": "layer_norm", "name": f"{n}_ln2", "bottom": f"{n}_r", "top": f"{n}_h2"},
        {"type": "fc", "name": f"{n}_fc", "bottom": f"{n}_h2", "top": f"{n}_u",
         "num_output": 4 * width, "axis": -1},
        {"type": "gelu", "name": f"{n}_gelu", "bottom": f"{n}_u", "top": f"{n}_u",
         "approximate": "tanh"},
        {"type": "fc", "name": f"{n}_proj", "bottom": f"{n}_u", "top": f"{n}_m",
         "num_output": width, "axis": -1},
        {"type": "eltwise", "name": f"{n}_res2", "bottom": [f"{n}_r", f"{n}_m"],
         "top": f"x{i + 1}"},
    ]


def gpt_config(path, layers=2, width=16, heads=4, length=8, batch=4, iters=4,
               parallel=None, fused=True, solver="adamw"):
    """A tiny GPT on the token file ``path``: embedding, position embedding,
    ``layers`` blocks, ln_f, the head tied to the embedding, the token loss."""
    net = [{"type": "embedding", "name": "wte", "bottom": "data", "top": "tok",
            "input_dim": 256, "num_output": width},
           {"type": "position_embedding", "name": "wpe", "bottom": "tok", "top": "x0",
            "max_length": length}]
    for i in range(layers):
        net += block(i, width, heads, fused)
    net += [{"type": "layer_norm", "name": "ln_f", "bottom": f"x{layers}", "top": "hf"},
            {"type": "fc", "name": "lm_head", "bottom": "hf", "top": "logits",
             "num_output": 256, "axis": -1, "bias_term": False, "tie_weight": "wte"},
            {"type": "softmax_loss", "name": "loss", "bottom": ["logits", "label"],
             "top": "loss", "axis": -1}]
    data = {"source": "text", "path": path, "sequence_length": length}
    return {
        "name": "gpt_test", "seed": 7,
        "data": {"train": dict(data, split="train", batch_size=batch, shuffle=True),
                 "test": dict(data, split="val", batch_size=4, shuffle=False)},
        "net": net,
        "solver": {"type": solver, "base_lr": 0.003, "max_iter": iters, "display": 1,
                   "test_interval": 0, "test_iter": 2, "weight_decay": 0.01},
        "checkpoint": {"interval": 0},
        "parallel": parallel or {},
    }


def block_stages(layers=2):
    """Two pipeline stages cut between the blocks: the embeddings and the
    first half of the blocks on stage 0, the rest and the head on stage 1."""
    cfg = gpt_config("unused", layers=layers)
    cut = layers // 2
    stages = {}
    for layer in cfg["net"]:
        name = layer["name"]
        blk = int(name[1:].split("_")[0]) if name.startswith("b") and "_" in name else None
        stages[name] = 0 if name in ("wte", "wpe") or (blk is not None and blk < cut) else 1
    return stages
