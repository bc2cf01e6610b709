"""The one-way import rule of docs/DESIGN.md, checked on the code.

Every module of purine_mpi belongs to one layer; a module imports only
modules of its own layer or of the layers below (lazy imports inside
functions count too), and no two modules import each other, directly or
through others. A new module must be given a layer here and in
docs/DESIGN.md, or this test names it.
"""
import ast
import os
import re
from collections import defaultdict

from tests.conftest import REPO

PACKAGE = os.path.join(REPO, "purine_mpi")

#: bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("foundation", ["purine_mpi", "purine_mpi.errors", "purine_mpi.progress",
                    "purine_mpi.philox", "purine_mpi.backend", "purine_mpi.threads",
                    "purine_mpi.logfile", "purine_mpi.runfiles"]),
    # device helpers: the kernel loader and wrappers, streams, cuBLAS, cuDNN, scratch
    ("devices", ["purine_mpi.gpu"]),
    ("data", ["purine_mpi.io.data", "purine_mpi.io.datasets", "purine_mpi.io.transform",
              "purine_mpi.io.filecache", "purine_mpi.io.h5links",
              "purine_mpi.io.lmdb_source", "purine_mpi.io.protowire"]),
    # op kernels (compute and communication) and their registry
    ("ops", ["purine_mpi.ops", "purine_mpi.comm", "purine_mpi.kernels"]),
    # the bi-graph, its gradient, the layers that emit sub-graphs
    ("graph", ["purine_mpi.graph", "purine_mpi.layers"]),
    # the job: its config, the single-replica model, its files on disk
    ("job", ["purine_mpi.io", "purine_mpi.io.job", "purine_mpi.model"]),
    # parallel schemes as graph compositions, placement on a device
    ("composition", ["purine_mpi.parallel", "purine_mpi.graph.partition",
                     "purine_mpi.gpu.placement", "purine_mpi.gpu.fuse"]),
    ("dispatch", ["purine_mpi.runtime"]),
    # what runs a job and looks at it: the loop, its services, the parameter
    # servers' loop, tools over graphs and traces, model formats
    ("services", ["purine_mpi.trainer", "purine_mpi.train", "purine_mpi.runlog",
                  "purine_mpi.bench", "purine_mpi.plot", "purine_mpi.predict",
                  "purine_mpi.docgen", "purine_mpi.docgen_sections",
                  "purine_mpi.docgen_examples", "purine_mpi.interop",
                  "purine_mpi.graph.inspect", "purine_mpi.parallel.param_server",
                  "purine_mpi.parallel.async_server", "purine_mpi.parallel.pipeline_stats",
                  "purine_mpi.scaling"]),
    ("cli", ["purine_mpi.cli", "purine_mpi.cli_args", "purine_mpi.__main__"]),
]


def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and \
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
    assert layer_of("purine_mpi.ops.conv") < layer_of("purine_mpi.trainer")
    assert layer_of("purine_mpi.gpu.placement") > layer_of("purine_mpi.ops.solver")
    assert layer_of("purine_mpi.gpu.kernels.image") == layer_of("purine_mpi.gpu")


def test_every_module_says_its_layer():
    """Each module's docstring names its layer and what it may import
    ("Layer: <name> (docs/DESIGN.md); may import ..."), as the table says."""
    wrong = []
    for module, path in sorted(_modules().items()):
        doc = ast.get_docstring(ast.parse(open(path).read())) or ""
        said = re.search(r"Layer: (\w+) \(docs/DESIGN\.md\); may import", doc)
        index = layer_of(module)
        if index is None or not said or said.group(1) != LAYERS[index][0]:
            wrong.append(f"{module}: says {said.group(1) if said else 'nothing'}, is "
                         f"{LAYERS[index][0] if index is not None else 'in no layer'}")
    assert not wrong, "\n".join(wrong)
