"""The ``Scheme`` interface and its registry (purine_mpi/parallel/schemes/):
every scheme registered, callers asking the registry instead of comparing
names, and a new scheme as one module plus one registry line."""
import ast
import dataclasses
import glob
import os

import pytest

from purine_mpi.base.errors import ConfigError
from purine_mpi.job import schema
from purine_mpi.job.schema import PARALLEL_MODES
from purine_mpi.parallel import compose
from purine_mpi.parallel.schemes import (SCHEMES, Composition, Scheme, mode_class,
                                         register_scheme, scheme_class, scheme_names, scheme_of)
from purine_mpi.parallel.schemes.base import Layout
from tests.conftest import REPO, make_job, tiny_fc_config

SCHEMES_DIR = "purine_mpi/parallel/schemes/"
#: the config language sits below parallel/ (tests/test_layers.py): it
#: validates the names and their cross-key rules before any scheme is loaded
CONFIG_DIR = "purine_mpi/job/"
#: the names a comparison must not test: the schemes' and the parallel modes
NAMES = set(scheme_names()) | set(PARALLEL_MODES) | set(SCHEMES)


def _is_scheme_or_mode(node):
    """``scheme``, ``x.scheme``, ``x["scheme"]`` (or ``mode``)."""
    if isinstance(node, ast.Name):
        return node.id in ("scheme", "mode")
    if isinstance(node, ast.Attribute):
        return node.attr in ("scheme", "mode")
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value in ("scheme", "mode")
    return False


def _names_in(node):
    """The string literals of ``node``: a constant or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}
    return set()


def name_comparisons(source):
    """[(line, text)] of the comparisons of a scheme or mode against a
    scheme's or mode's name (==, !=, in, not in)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left] + list(node.comparators)
        for op, a, b in zip(node.ops, sides, sides[1:]):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            for subject, other in ((a, b), (b, a)):
                if _is_scheme_or_mode(subject) and _names_in(other) & NAMES:
                    hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_the_scan_finds_name_comparisons():
    text = ('a = par.scheme == "tensor"\nb = scheme in ("pipeline", "hybrid")\n'
            'c = job.parallel.mode != "sync"\nd = par["mode"] not in ["async"]\n'
            'e = "data" == lay.scheme\n')
    assert len(name_comparisons(text)) == 5
    # other modes (an early-stopping watch's) and other names pass
    assert name_comparisons('a = self.mode == "max"\nb = image.mode in ("L", "1")\n'
                            'c = scheme is None\n') == []


def test_no_module_outside_the_schemes_compares_a_scheme_name():
    """Callers look a scheme up and ask it (a capability, a method); only
    the schemes' own modules know their names."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "purine_mpi", "**", "*.py"),
                                 recursive=True)):
        rel = os.path.relpath(path, REPO).replace(os.sep, "/")
        if rel.startswith((SCHEMES_DIR, CONFIG_DIR)):
            continue
        with open(path, encoding="utf-8") as f:
            found += [f"{rel}:{line}: {text}" for line, text in name_comparisons(f.read())]
    assert not found, "scheme names compared outside parallel/schemes/ (ask the registry):\n" + \
        "\n".join(found)


def test_the_registry_lists_every_scheme():
    assert list(SCHEMES) == ["data", "param_server", "none", "pipeline", "hybrid", "tensor",
                            "sharded"]
    # each choice of the config language (documented) has its scheme, and back
    assert scheme_names() == schema.PARALLEL_SCHEMES
    # auto is no scheme: train chooses one at start-up (tools/choose.py)
    assert set(schema.CHOICE_DOCS["scheme"]) == set(schema.PARALLEL_SCHEMES) | {
        schema.AUTO_SCHEME}
    assert {m for cls in SCHEMES.values() for m in cls.modes} == set(PARALLEL_MODES)
    for cls in SCHEMES.values():
        assert issubclass(cls, Scheme), cls
    # every (scheme, mode) of the config language finds its class
    assert scheme_class("data", "sync").name == "data"
    assert scheme_class("data", "async") is scheme_class("data", "sync_ps") is \
        SCHEMES["param_server"]
    assert scheme_class("pipeline", "async") is None          # refused at validation
    assert mode_class("sync") is None and mode_class("async").servers


@pytest.mark.parametrize("parallel,name,caps", [
    ({}, "data", {"nccl": True, "staged": False, "servers": False, "micro_batches": True}),
    ({"mode": "sync_ps"}, "param_server", {"servers": True, "micro_batches": True,
                                           "nccl": False}),
    ({"scheme": "none"}, "none", {"exchanges_gradients": False, "nccl": False}),
    ({"scheme": "pipeline", "stages": {"fc": 0, "l": 1}},
     "pipeline", {"staged": True, "allreduces": False}),
    ({"scheme": "tensor"}, "tensor", {"micro_batches": False, "deferrable": False}),
])
def test_capabilities_are_declared(parallel, name, caps):
    cfg = dict(tiny_fc_config(), parallel=parallel)
    scheme = scheme_of(make_job(cfg))
    assert scheme.name == name
    for cap, value in caps.items():
        assert getattr(scheme, cap) == value, cap


class _World:
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


def test_a_new_scheme_is_one_module_and_one_registry_line(monkeypatch):
    """A scheme registered from here (its module) lays out, composes into a
    typed Composition and speaks in the notes through the registry, with no
    other module edited (the config language takes its name once job/schema.py
    lists it: docs/DESIGN.md)."""
    monkeypatch.setattr("purine_mpi.parallel.schemes.base.SCHEMES", dict(SCHEMES))

    @register_scheme("solo")
    class Solo(Scheme):
        keys = ("stages",)              # reads parallel.stages: no note on it
        exchanges_gradients = False

        def compose(self, graph, grads, job, world):
            return Composition(graph.validate(), self.layout(job, world))

        def why_no_buckets(self, par):
            return "scheme solo sums nothing"

    assert scheme_class("solo") is Solo and "solo" in scheme_names()
    cfg = dict(tiny_fc_config(), parallel={"scheme": "pipeline", "stages": {"fc": 0, "l": 1}})
    job = make_job(cfg)
    # the job's parallel section with the new name (the config's choice check
    # holds the shipped list; docs/DESIGN.md says where a new name goes)
    job = job.replace(parallel=dataclasses.replace(job.parallel, scheme="solo", bucket_mb=8,
                                                   tensor_parallel=2))
    assert isinstance(scheme_of(job), Solo)
    notes = compose.settings_without_effect(job, 2)
    assert any("bucket_mb" in n and "scheme solo sums nothing" in n for n in notes), notes
    assert any("tensor_parallel applies to schemes pipeline and hybrid and tensor and "
               "sharded only; "
               "scheme solo "
               "ignores it" in n
               for n in notes), notes
    lay = compose.layout_of(job, _World(3, 2))
    assert isinstance(lay, Layout) and (lay.scheme, lay.replicas, lay.replica) == ("solo", 3, 2)
    from purine_mpi.job.replica import build_train_graph
    graph, grads = build_train_graph(job, 0, 1)
    assert compose.compose(graph, grads, job, _World(1)) is graph


def test_unknown_scheme_still_refused():
    with pytest.raises(ConfigError, match="parallel.scheme"):
        make_job(dict(tiny_fc_config(), parallel={"scheme": "solo"}))


def test_composition_replaces_graph_attributes():
    """compose() gives the graph; the plan it made is the Composition's, not
    an attribute stuck on the graph."""
    from purine_mpi.job.replica import build_train_graph
    job = make_job(tiny_fc_config())
    graph, grads = build_train_graph(job, 0, 2)
    offline = job.replace(parallel=dataclasses.replace(job.parallel, check_collectives=False))
    comp = scheme_of(job).compose(graph, grads, offline, _World(2))
    assert isinstance(comp, Composition) and comp.bucket_plan
    assert comp.layout.replicas == 2
    for attr in ("bucket_plan", "layout", "transport", "tensor_plan", "windows"):
        assert attr not in vars(comp.graph), attr


STAND_INS = [pytest.param(lambda: Scheme, id="Scheme"),
             pytest.param(lambda: Scheme(), id="Scheme()"),
             pytest.param(lambda: compose.Scheme(), id="JobScheme()"),
             pytest.param(lambda: type("Step", (compose.Scheme,), {})(), id="subclass()")]


@pytest.mark.parametrize("stand_in", STAND_INS)
def test_a_stand_ins_capability_is_no_class_default(stand_in):
    """A stand-in for the job's scheme (the bare Scheme, compose's
    JobScheme, a test's subclass) has no capabilities: reading one raised
    nothing and gave the class default (scheme none's ranks counted their
    ignored labels jointly: exchanges_gradients True). Every capability
    raises a TypeError naming the way to the job's scheme; registered
    schemes, their classes and their subclasses (a parameter-server
    worker) answer their own or the default."""
    from purine_mpi.parallel.param_server import WorkerScheme
    from purine_mpi.parallel.schemes.base import CAPABILITIES
    for cap in CAPABILITIES:
        with pytest.raises(TypeError, match=rf"stands for the job's scheme.*scheme_of\(job\)\.{cap}"):
            getattr(stand_in(), cap)
    declared = [n for n, v in vars(Scheme).items() if type(v).__name__ == "Capability"]
    assert sorted(declared) == sorted(CAPABILITIES)
    job = make_job(dict(tiny_fc_config(), parallel={"scheme": "none"}))
    scheme = stand_in()
    own = (scheme() if isinstance(scheme, type) else scheme).job_scheme(job)
    assert type(own) is SCHEMES["none"] and own.exchanges_gradients is False
    for cls in list(SCHEMES.values()) + [WorkerScheme]:
        assert {cap: getattr(cls, cap) for cap in CAPABILITIES} == \
            {cap: getattr(cls.__new__(cls), cap) for cap in CAPABILITIES}
    assert SCHEMES["data"].nccl is True and SCHEMES["none"].exchanges_gradients is False
    assert WorkerScheme.defer_loss_readback is False and WorkerScheme.servers is True


def test_a_stand_in_answers_as_the_jobs_scheme():
    """Scheme none on 2 ranks through a stand-in: the methods given the job
    answer the job's scheme's (before, ``settings_without_effect`` read the
    stand-in's class default and named scheme none's bucket keys as keys of
    an allreduce on 1 rank)."""
    job = make_job(dict(tiny_fc_config(), parallel={"scheme": "none", "bucket_mb": 8}))
    none = scheme_of(job)
    for scheme in (Scheme(), compose.Scheme()):
        for size in (1, 2):
            assert scheme.settings_without_effect(job, size) == \
                none.settings_without_effect(job, size)
            assert scheme.shards(job, size) == none.shards(job, size) == 1
        lay = scheme.layout(job, _World(2))
        assert scheme.trains_apart(job, lay) is True


def test_a_stand_in_may_not_declare_a_capability(monkeypatch):
    """A subclass of the stand-in that sets a capability (a class attribute,
    a patch of its class) would be ignored, the job's scheme answering: its
    first question to the job's scheme is refused, naming the key."""
    job = make_job(tiny_fc_config())

    class Declares(compose.Scheme):
        defers_update = False

    with pytest.raises(TypeError, match="Declares sets defers_update.*type\\(scheme_of\\(job\\)\\)"):
        Declares().layout(job, _World(2))
    with pytest.raises(TypeError, match="JobScheme.defer_loss_readback: JobScheme stands for"):
        monkeypatch.setattr(compose.Scheme, "defer_loss_readback", False)
    step = type("Step", (compose.Scheme,), {})
    step.staged = True  # a patch of a stand-in's class
    with pytest.raises(TypeError, match="Step sets staged"):
        step().compose(None, None, job, _World(2))
