"""The one-way import rule of docs/DESIGN.md, checked on the code.

Every module of purine_mpi belongs to one layer; a module imports only
modules of its own layer or of the layers below (lazy imports inside
functions count too), and no two modules import each other, directly or
through others. A module's layer is its folder's: LAYERS
below has one line per folder; a new folder is given a layer here and in
docs/DESIGN.md's table, or these tests name it.
"""
import ast
import os
import re
from collections import defaultdict

from tests.conftest import REPO

PACKAGE = os.path.join(REPO, "purine_mpi")

#: bottom to top, one line per folder (a top-level module is named whole):
#: (layer, its folders and top-level modules). docs/DESIGN.md's layer
#: table shows the same rows, in this order (test_design_shows_the_layers).
LAYERS = [
    ("base", ["purine_mpi.base", "purine_mpi"]),
    ("gpu", ["purine_mpi.gpu"]),
    ("data", ["purine_mpi.data"]),
    ("ops", ["purine_mpi.ops", "purine_mpi.comm"]),
    ("graph", ["purine_mpi.graph", "purine_mpi.layers"]),
    ("job", ["purine_mpi.job"]),
    ("parallel", ["purine_mpi.parallel"]),
    ("runtime", ["purine_mpi.runtime"]),
    ("interop", ["purine_mpi.interop"]),
    ("train", ["purine_mpi.train"]),
    ("tools", ["purine_mpi.tools"]),
    ("cli", ["purine_mpi.cli", "purine_mpi.cli_args", "purine_mpi.__main__"]),
]


def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or (prefix != "purine_mpi" and
                                      module.startswith(prefix + "."))) and \
                    (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def import_edges():
    """{module: {purine_mpi modules it imports, anywhere in its code}}."""
    modules = _modules()
    edges = defaultdict(set)
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] +
                                    ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if not base.startswith("purine_mpi"):
                    continue
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges[module].add(target if target in modules else base)
            elif isinstance(node, ast.Import):
                edges[module] |= {a.name for a in node.names if a.name.startswith("purine_mpi")}
        edges[module].discard(module)
    return modules, edges


def test_every_module_has_a_layer():
    modules, _ = import_edges()
    assert [m for m in modules if layer_of(m) is None] == []


def test_no_import_runs_up_the_layers():
    _, edges = import_edges()
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(edges.items()) for t in sorted(targets)
              if layer_of(t) is not None and layer_of(t) > layer_of(m)]
    assert upward == []


def test_no_import_circle():
    modules, edges = import_edges()
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if t not in modules:
                continue
            if state.get(t) == "open":
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m)
    assert circles == []


def test_the_rule_catches_an_upward_import():
    """The check itself: an op that imported the trainer would be named."""
    assert layer_of("purine_mpi.ops.conv") < layer_of("purine_mpi.train.trainer")
    assert layer_of("purine_mpi.parallel.placement") > layer_of("purine_mpi.ops.updates")
    assert layer_of("purine_mpi.gpu.kernels.image") == layer_of("purine_mpi.gpu")


def _design_rows():
    """The layer table of docs/DESIGN.md: [(layer, [folders and modules])]."""
    text = open(os.path.join(REPO, "docs/DESIGN.md")).read()
    table = text.split("## The layers, bottom to top", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("layer", "---"):
            rows.append((cells[0], re.findall(r"`([\w/]+)`", cells[1])))
    return rows


def _as_paths(names):
    return [n[len("purine_mpi."):].replace(".", "/") + "/"
            if n != "purine_mpi" and os.path.isdir(os.path.join(REPO, n.replace(".", os.sep)))
            else ("purine_mpi/__init__" if n == "purine_mpi" else n[len("purine_mpi."):])
            for n in names]


def test_design_shows_the_layers():
    """docs/DESIGN.md's table has this file's rows: the same layers, in the same
    order, each with the same folders and top-level modules."""
    assert _design_rows() == [(name, _as_paths(names)) for name, names in LAYERS]


def test_a_net_is_inferred_once_not_once_per_layer(monkeypatch):
    """layers/build.NetBuilder.shape infers the ops added since it was last
    asked (Graph.infer_shapes(ops)), not the whole graph again for each
    layer that asks: quadratic in the layers (each of 30 fc layers
    re-inferred the data op, which reads its source's metadata, and every
    layer before it). The data op's ``infer`` runs three times: the data
    op alone, the first layer's question, build_net's whole graph at its
    end; the shapes are those of a whole inference."""
    from purine_mpi.job.replica import forward_graph
    from purine_mpi.ops.data import DataReader
    from tests.conftest import make_job
    calls, real = [], DataReader.infer.__func__
    monkeypatch.setattr(DataReader, "infer",
                        classmethod(lambda cls, attrs, ins: calls.append(1) or
                                    real(cls, attrs, ins)))
    net = [{"type": "fc", "name": f"fc{i}", "bottom": f"fc{i - 1}" if i else "data",
            "top": f"fc{i}", "num_output": 8 + i} for i in range(30)]
    net.append({"type": "softmax_loss", "name": "loss", "bottom": ["fc29", "label"],
                "top": "loss"})
    job = make_job({"name": "deep", "net": net, "solver": {"base_lr": 0.1, "max_iter": 1},
                    "data": {"train": {"source": "synthetic", "shape": [4], "classes": 37,
                                       "num_samples": 16, "batch_size": 4}}})
    g = forward_graph(job, "train", job.data.train)
    assert len(calls) == 3, len(calls)
    assert [g.blobs[f"fc{i}"].shape for i in range(30)] == [(4, 8 + i) for i in range(30)]
    assert g.blobs["fc0/weight"].shape == (8, 4)
