"""Pricing an op from a traced op of another size (tools/scaling/work.py,
tools/choose.py ``_Scaled``): ``plan --choose`` times every candidate's ops
from two traces on one rank, of the whole batch and of a quarter of it
(``affine_costs``: each op's time as fixed + rate * work), or from the
whole batch's alone (the proportional rule).

The net has a wide fully connected layer (a 1,536 x 1,536 weight, 9 MiB,
against 16 x 1,536 activations, 96 KiB), so an op of a micro-batch priced
by all the bytes it touches would cost nearly the whole batch's time; by
its work (FLOPs, or the batch's bytes) it costs 1/M of it."""
import pytest

from purine_mpi.job.config import load_job
from purine_mpi.tools.choose import CALIBRATION_SETS, Predictor, _Scaled, affine_costs, \
    small_batch
from purine_mpi.tools.graph import compose_for
from purine_mpi.tools.scaling.link import make_link
from purine_mpi.tools.scaling.trace_reader import Durations
from purine_mpi.tools.scaling.work import affine_fit, op_work, weight_blobs

BATCH = 16
NET = f"""name: work_net
seed: 3
data:
  train: {{source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 64,
           batch_size: {BATCH}}}
net:
  - {{type: fc, name: fc1, bottom: data, top: fc1, num_output: 1536}}
  - {{type: relu, name: relu1, bottom: fc1, top: fc1}}
  - {{type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 1536}}
  - {{type: relu, name: relu2, bottom: fc2, top: fc2}}
  - {{type: fc, name: fc3, bottom: fc2, top: fc3, num_output: 10}}
  - {{type: softmax_loss, name: loss, bottom: [fc3, label], top: loss}}
solver: {{type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 10}}
"""
STAGES = "parallel.stages={fc1: 0, relu1: 0, fc2: 1, relu2: 1, fc3: 1, loss: 1}"


#: the second trace's batch (``small_batch``: a quarter of 16)
SMALL = small_batch(BATCH)
#: the synthetic law of both traces: the share of an op's time at the
#: whole batch that is its cost per call; at the small batch it takes that
#: plus the rest times its share of the work
FIXED = 0.2


def _small_trace(traced, small_graph, durations, fixed=FIXED):
    """Durations of ``small_graph`` (at SMALL) under the affine law through
    the whole batch's ``durations``; an op of equal work takes its time."""
    ops = {}
    for name in small_graph.ops:
        t = durations.lookup(name, 0)
        was, now = op_work(traced, name)[1], op_work(small_graph, name)[1]
        ops[name] = t * (fixed + (1.0 - fixed) * now / was) if was else t
    return Durations({0: ops})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("work") / "net.yaml"
    path.write_text(NET)
    traced = compose_for(load_job(path, CALIBRATION_SETS, check_files=False), 1, 0)
    small_graph = compose_for(load_job(path, CALIBRATION_SETS + (
        f"data.train.batch_size={SMALL}",), check_files=False), 1, 0)
    # every traced op took 1 s: a candidate's op costs its share of the work
    durations = Durations({0: {name: 1.0 for name in traced.ops}})
    return path, traced, durations, small_graph


def _scaled(setup, sets, n, rank, small=None):
    """The candidate's graph and its _Scaled: proportional, or with the
    affine costs fitted from the ``small`` trace (Durations at SMALL)."""
    path, traced, durations, small_graph = setup
    graph = compose_for(load_job(path, sets, check_files=False), n, rank)
    fit = affine_costs(durations, traced, small, small_graph) if small else None
    return graph, _Scaled(durations, traced, graph, fit)


MICRO_OPS = ("fc2.fwd", "fc2.bwd.inner_product_grad_data",
             "fc2.bwd.inner_product_grad_weight", "relu2.fwd", "relu2.bwd.relu_grad")


@pytest.mark.parametrize("m", [2, 4, 8])
def test_an_op_of_a_micro_batch_costs_fixed_plus_its_share_of_the_rest(setup, m):
    """With the second trace, an op of a micro-batch costs its fixed part
    plus the rest times 1/M (here 0.2 + 0.8 / M of the whole batch's
    second); with the whole batch's trace alone, exactly 1/M (the
    proportional rule). The update runs once per iteration on the whole
    weight: 1 s either way."""
    sets = ("parallel.scheme=pipeline", STAGES, f"parallel.micro_batches={m}")
    _, traced, durations, small_graph = setup
    _, proportional = _scaled(setup, sets, 2, 1)
    _, affine = _scaled(setup, sets, 2, 1, _small_trace(traced, small_graph, durations))
    for op in MICRO_OPS:
        for k in range(m):
            assert proportional.lookup(f"{op}@mb{k}") == pytest.approx(1.0 / m), (op, k)
            assert affine.lookup(f"{op}@mb{k}") == pytest.approx(FIXED + (1 - FIXED) / m), \
                (op, k)
    for scaled in (proportional, affine):
        assert scaled.lookup("fc2/weight.update") == pytest.approx(1.0)


def test_the_affine_fit_recovers_its_law_and_clamps_a_noisy_small_trace():
    # two points of t = 0.3 + 0.01 w: the law itself; between and beyond them too
    fixed, rate = affine_fit(0.3 + 0.01 * 100, 100, 0.3 + 0.01 * 25, 25)
    assert (fixed, rate) == (pytest.approx(0.3), pytest.approx(0.01))
    assert affine_fit(2.0, 64, 2.0, 64) is None  # equal work: nothing to fit
    # the small batch slower than the whole (noise): its time at any size
    assert affine_fit(1.0, 100, 1.2, 25) == (1.0, 0.0)
    # faster than its share of the work: no negative fixed part (proportional)
    assert affine_fit(1.0, 100, 0.1, 25) == (0.0, pytest.approx(0.01))


def test_a_noisy_small_trace_is_clamped_op_by_op(setup):
    _, traced, durations, small_graph = setup
    small = _small_trace(traced, small_graph, durations)
    small.per_rank[0]["fc2.fwd"] = 1.5  # slower at a quarter of the batch
    small.per_rank[0]["relu2.fwd"] = 0.01  # faster than its quarter
    del small.per_rank[0]["fc1.fwd"]  # in one trace only
    _, scaled = _scaled(setup, ("parallel.scheme=pipeline", STAGES,
                                "parallel.micro_batches=4"), 2, 1, small)
    _, first = _scaled(setup, ("parallel.scheme=pipeline", STAGES,
                               "parallel.micro_batches=4"), 2, 0, small)
    assert scaled.lookup("fc2.fwd@mb0") == pytest.approx(1.0)
    assert scaled.lookup("relu2.fwd@mb0") == pytest.approx(0.25)
    assert first.lookup("fc1.fwd@mb0") == pytest.approx(0.25)
    assert scaled.lookup("fc2.bwd.inner_product_grad_data@mb0") == pytest.approx(0.4)


def test_the_affine_law_ranks_micro_batches_of_call_bound_ops_right(setup):
    """By construction every op of the batch is almost all cost per call
    (0.9 of its 1 s at the whole batch; the updates, of equal work in both
    traces, 0.01 s): cutting the batch into 4 micro-batches runs each op 4
    times at nearly its whole cost, so a pipeline of 2 stages is slower at
    4 micro-batches than at 1. The proportional rule prices each micro-
    batch's op at 1/4 of the batch's and ranks 4 micro-batches first; the
    affine costs fitted from the two traces rank 1 first."""
    path, traced, _, small_graph = setup
    calib = load_job(path, CALIBRATION_SETS, check_files=False)
    small_job = load_job(path, CALIBRATION_SETS + (f"data.train.batch_size={SMALL}",),
                         check_files=False)
    durations = Durations({0: {name: 1.0 if op_work(traced, name) != op_work(small_graph, name)
                               else 0.01 for name in traced.ops}})
    small = _small_trace(traced, small_graph, durations, fixed=0.9)
    link = make_link(None, None, None)
    period = {}
    for law, pair in (("proportional", None), ("affine", (small, small_job))):
        predictor = Predictor(calib, durations, link, small=pair)
        for m in (1, 4):
            job = load_job(path, ("parallel.scheme=pipeline", STAGES,
                                  f"parallel.micro_batches={m}"), check_files=False)
            period[law, m] = predictor.predict(job, 2)[0]
    assert period["proportional", 1] == pytest.approx(period["affine", 1])
    assert period["proportional", 4] < period["proportional", 1]
    assert period["affine", 4] > period["affine", 1]


def test_a_matrix_product_counts_flops_and_other_ops_the_batchs_bytes(setup):
    graph, _ = _scaled(setup, ("parallel.scheme=pipeline", STAGES,
                               "parallel.micro_batches=2"), 2, 1)
    weights = weight_blobs(graph)
    assert {"fc2/weight", "fc2/weight.grad@mb0", "fc2/weight.momentum"} <= weights
    assert not {"fc2@mb0", "fc2.grad@mb0", "fc1@mb0"} & weights
    rows = BATCH // 2
    assert op_work(graph, "fc2.fwd@mb0") == ("flops", 2 * rows * 1536 * 1536)
    assert op_work(graph, "fc2.bwd.inner_product_grad_weight@mb0") == (
        "flops", 2 * 1536 * 1536 * rows)
    # ReLU in place or not: its input and output, 4 bytes a float, no weight
    unit, nbytes = op_work(graph, "relu2.fwd@mb0")
    assert unit == "bytes" and nbytes in (rows * 1536 * 4, 2 * rows * 1536 * 4)
    assert op_work(graph, "fc2/weight.update")[0] == "all bytes"


def test_the_row_chunks_of_a_weight_gradient_sum_to_the_whole(setup):
    graph, scaled = _scaled(setup, ("parallel.scheme=data",), 2, 0)
    chunks = [n for n in graph.ops if n.startswith("fc2.bwd.inner_product_grad_weight[")]
    assert len(chunks) > 1  # cut into the buckets' rows
    assert sum(scaled.lookup(n) for n in chunks) == pytest.approx(1.0)


#: the net with a residual sum (an Eltwise forward, a Sum of fc1's two
#: gradients backward): the calibration traces element-wise sums
RESIDUAL = NET.replace(
    "  - {type: fc, name: fc3, bottom: fc2,",
    "  - {type: eltwise, name: res, bottom: [fc1, fc2], top: res}\n"
    "  - {type: fc, name: fc3, bottom: res,")
RES_STAGES = "parallel.stages={fc1: 0, relu1: 0, fc2: 1, relu2: 1, res: 1, fc3: 1, loss: 1}"


def test_a_micro_batchs_gradient_sums_cost_their_bytes_at_the_traced_sum_rate(tmp_path):
    """The M-1 sums per weight gradient of M micro-batches (``<grad>.
    micro_sum...``) are in no calibration trace: each costs its bytes
    written at the seconds per byte of the traced sums (the Eltwise and the
    Sum, 0.3 s and 0.5 s here), and they leave the untraced count. Before,
    they counted 0 s and as untraced."""
    from purine_mpi.tools.choose import elementwise_rates
    from purine_mpi.tools.scaling.model import Scenario, Template
    path = tmp_path / "res.yaml"
    path.write_text(RESIDUAL)
    calib = load_job(path, CALIBRATION_SETS, check_files=False)
    traced = compose_for(calib, 1, 0)
    sums = {n: op for n, op in traced.ops.items() if op.op_type in ("Sum", "Eltwise")}
    assert {op.op_type for op in sums.values()} == {"Sum", "Eltwise"}
    times = {n: (0.3 if op.op_type == "Eltwise" else 0.5) for n, op in sums.items()}
    durations = Durations({0: {n: times.get(n, 0.01) for n in traced.ops}})
    written = sum(traced.blobs[op.outputs[0]].nbytes for op in sums.values())
    rate = sum(times.values()) / written
    assert elementwise_rates(durations, traced) == {"sum": pytest.approx(rate)}
    predictor = Predictor(calib, durations, make_link(None, None, None))
    untraced = {}
    for m in (1, 4):
        job = load_job(path, ("parallel.scheme=pipeline", RES_STAGES,
                              f"parallel.micro_batches={m}"), check_files=False)
        untraced[m] = predictor.predict(job, 2)[2]
        scenario = Scenario(job, 2)
        t = Template(job, scenario, 1)
        scaled = _Scaled(durations, traced, t.graph, predictor.fit, predictor.rates)
        micro = [n for n in t.graph.ops if ".micro_sum" in n]
        assert len(micro) == (m - 1) * 4  # fc2's and fc3's weight and bias (stage 1)
        for name in micro:
            nbytes = t.graph.blobs[t.graph.ops[name].outputs[0]].nbytes
            assert scaled.lookup(name) == pytest.approx(nbytes * rate) and nbytes > 0, name
        if m == 4:
            assert scaled.lookup("fc2/weight.grad.micro_sum") == pytest.approx(
                1536 * 1536 * 4 * rate)
    assert untraced[4] == untraced[1]  # before: 12 more, the sums (at 0 s)


def test_a_replicas_clipping_of_its_summed_gradient_costs_the_traced_clip_rate(setup):
    """Data parallelism on 2 ranks clips the replicas' summed gradients
    (``<grad>.sum.clip``), named otherwise than the one rank's trace
    (``<grad>.clip``): each costs its bytes written at the traced clipping
    ops' seconds per byte, and none is untraced. Before: 0 s, untraced."""
    path, _, _, _ = setup
    clip = ("solver.clip_gradients=1.0",)
    calib = load_job(path, CALIBRATION_SETS + clip, check_files=False)
    traced = compose_for(calib, 1, 0)
    clips = [n for n, op in traced.ops.items() if op.op_type == "ClipScale"]
    assert clips and all(n.endswith(".grad.clip") for n in clips)
    durations = Durations({0: {n: (0.2 if n in clips else 0.01) for n in traced.ops}})
    rate = 0.2 * len(clips) / sum(traced.blobs[traced.ops[n].outputs[0]].nbytes for n in clips)
    predictor = Predictor(calib, durations, make_link(None, None, None))
    job = load_job(path, ("parallel.scheme=data",) + clip, check_files=False)
    graph = compose_for(job, 2, 0)
    scaled = _Scaled(durations, traced, graph, predictor.fit, predictor.rates)
    summed = [n for n, op in graph.ops.items() if op.op_type == "ClipScale"]
    assert summed and not set(summed) & set(clips)
    for name in summed:
        nbytes = graph.blobs[graph.ops[name].outputs[0]].nbytes
        assert scaled.lookup(name) == pytest.approx(nbytes * rate) and nbytes > 0, name
    assert predictor.predict(job, 2)[2] == 0


def test_with_no_traced_sum_a_micro_batchs_gradient_sums_cost_the_host_add_rate(setup):
    """The net traces no Sum: a micro-batch's gradient sums keep no
    calibration rate, so the predictor prices each at its bytes written
    times the host's measured add rate (``copy_cost``, as an untraced
    Copy) and still counts it as untraced. Before: 0 s."""
    from purine_mpi.tools.scaling.model import Scenario, Template
    path, traced, durations, _ = setup
    predictor = Predictor(load_job(path, CALIBRATION_SETS, check_files=False), durations,
                          make_link(None, None, None))
    assert "sum" not in predictor.rates
    job = load_job(path, ("parallel.scheme=pipeline", STAGES, "parallel.micro_batches=2"),
                   check_files=False)
    scenario = Scenario(job, 2)
    t = Template(job, scenario, 1)
    scaled = _Scaled(durations, traced, t.graph, predictor.fit, predictor.rates)
    rate = 1e-9  # any host rate: the op costs its bytes at it
    g, _, missing = t.rank_graph(scaled, predictor.link, "auto", scenario, rate)
    micro = [n for n in t.graph.ops if ".micro_sum" in n]
    assert micro and set(micro) <= set(missing)
    for name in micro:
        nbytes = t.graph.blobs[t.graph.ops[name].outputs[0]].nbytes
        assert g.ops[name].seconds == pytest.approx(nbytes * rate) and nbytes > 0, name


def test_every_recomputed_op_of_a_gpt_is_priced_from_its_traced_original(tmp_path):
    """Full recompute copies each op of a block as ``<op>@recompute``, or
    ``<op>@recompute#1`` where a blob already has that name (the attention
    scores, the dropout replay and the qkv product of a GPT, whose op and
    output share a name): each copy is priced from its traced original (its
    time where the op is the same, scaled by work for the dropout's replay
    of its packed mask), none is left untraced (0 s). Before: the ``#1`` copies,
    18 ops of jobs/gpt_small.yaml, were untraced."""
    from tests.gpt_nets import gpt_config, text_h5
    import yaml
    cfg = gpt_config(text_h5(tmp_path), layers=2, fused=False)
    for layer in cfg["net"]:
        if layer["type"] == "attention":
            layer["attn_dropout"] = 0.1
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump(cfg))
    traced = compose_for(load_job(path, CALIBRATION_SETS, check_files=False), 1, 0)
    durations = Durations({0: {name: 1.0 for name in traced.ops}})
    graph = compose_for(load_job(path, ("recompute=full",), check_files=False), 1, 0)
    copies = [n for n in graph.ops if "@recompute" in n]
    assert any("#" in n for n in copies), copies   # the case this test is about
    scaled = _Scaled(durations, traced, graph)
    for name in copies:
        seconds = scaled.lookup(name)
        assert seconds is not None and seconds > 0, name
        original = name.split("@recompute")[0]
        if graph.ops[name].op_type == traced.ops[original].op_type:
            assert seconds == pytest.approx(1.0), name   # the same op on the same work
