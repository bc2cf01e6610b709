"""The scaling predictor's parameter-server path (``parallel.mode:
sync_ps``): the predicted iteration of a worker against the closed form
of W workers sharing each server's link, on a synthetic calibration
(every compute op's seconds given, the link's α and β given).

A worker's iteration is its compute chain, then per parameter p the push
of p's gradient (B bytes) to p's server, which shares that server's link
with the other W - 1 workers' pushes (α + W·B/β), and the pull of the
fresh p, which waits for the push and the server's update of p (u) and
the server's sum of the W gradients (W - 1 adds of B bytes at the host's
add rate c) and shares the same link with the other workers' pulls
(u + (W-1)·B·c + α + W·B/β). Two
servers each hold their own link: a push to one does not wait for a
push to the other.

Found: the simulator ran every transfer to an unsimulated peer (a server)
on one outgoing and one incoming side of the worker's link, so with
``ps_ranks: 2`` the push to the second server waited for the push to the
first (the first closed form below, 2 servers, came out one push too
long: t1 + P + Q + (t2 + P - t1) instead of t1 + P + Q). Now each server
is its own link (simulate.VirtualClock.post: the free times per peer).
And the pull left out the server's sum of the W gradients (on the code
before: the one-server form, W = 2, c = 1e-7, came out (W-1)·B·c = 0.1 ms
short).
"""
import pytest

from purine_mpi.job.config import load_job
from purine_mpi.tools.scaling.link import Link
from tests.conftest import write_config_file

W_BYTES = 4 * 16 * 64  # an fc weight of 64 outputs x 16 inputs, float32


def _job(tmp_path, layers, ps_ranks=1, transport="auto"):
    """A net of ``layers`` fully connected layers (no bias: one parameter
    each, 16 -> 64 ... -> 64 -> 64 wide) under sync_ps."""
    net, bottom, width = [], "data", 16
    for i in range(layers):
        net.append({"type": "fc", "name": f"fc{i}", "bottom": bottom, "top": f"fc{i}",
                    "num_output": 64 if i < layers - 1 else 16, "bias_term": False})
        bottom = f"fc{i}"
    net.append({"type": "softmax_loss", "name": "loss", "bottom": [bottom, "label"],
                "top": "loss"})
    cfg = {"name": "ps_closed_form", "seed": 1,
           "data": {"train": {"source": "synthetic", "shape": [width], "classes": 16,
                              "num_samples": 64, "batch_size": 8}},
           "net": net,
           "solver": {"base_lr": 0.01, "momentum": 0.9, "max_iter": 8, "display": 0,
                      "test_interval": 0},
           "parallel": {"mode": "sync_ps", "ps_ranks": ps_ranks, "transport": transport}}
    return load_job(write_config_file(tmp_path, cfg), check_files=False)


def _predict(job, n, seconds, link, add_rate=0.0):
    from purine_mpi.tools.scaling.model import predict_one
    from purine_mpi.tools.scaling.trace_reader import Durations
    return predict_one(job, n, Durations({0: seconds}), link, "auto", add_rate, {})


@pytest.mark.parametrize("transport", ["two_sided", "one_sided"])
@pytest.mark.parametrize("n", [3, 5])
def test_one_server_shared_by_w_workers_is_the_closed_form(tmp_path, transport, n):
    """1 server, W = n - 1 workers, one parameter of B bytes: the iteration
    is the compute chain + (α + W·B/β) + (u + (W-1)·B·c + α + W·B/β);
    one-sided at the window's α_put and β_put."""
    job = _job(tmp_path, 1, transport=transport)
    sec = {"data": 0.010, "fc0.fwd": 0.020, "loss.fwd": 0.003,
           "loss.bwd.softmax_loss_grad": 0.004, "fc0.bwd.inner_product_grad_weight": 0.030,
           "fc0/weight.update": 0.007}
    link = Link(2e-4, 1e7, 0.0, "test", alpha_put=5e-5, beta_put=4e7)
    add = 1e-7  # the host's add rate c, seconds per byte
    got = _predict(job, n, sec, link, add)
    w, b = n - 1, 4 * 16 * 16
    update = sec["fc0/weight.update"] + (w - 1) * b * add
    a, beta = (link.alpha, link.beta) if transport == "two_sided" else \
        (link.alpha_put, link.beta_put)
    push = a + w * b / beta
    chain = sum(v for k, v in sec.items() if k != "fc0/weight.update")
    assert got["replicas"] == w and got["images"] == 8 * w
    assert got["comm_ops"] >= 2
    assert got["comm_s"] == pytest.approx(2 * push + update)
    assert got["compute_s"] == pytest.approx(chain)
    assert got["iter_s"] == pytest.approx(chain + 2 * push + update)


@pytest.mark.parametrize("transport", ["two_sided", "one_sided"])
def test_two_servers_each_share_their_own_link(tmp_path, transport):
    """2 servers, 2 workers (N = 4), two parameters of B bytes, one on
    each server (fc1's, the gradient ready first, on the first): the push
    of fc0's gradient, ready t1 - t2 after fc1's, does not wait for fc1's
    push (another server's link): the iteration ends at fc0's pull,
    t1 + P + Q, with P = α + W·B/β and Q = u + (W-1)·B·c + P, t1 the time
    fc0's gradient is ready."""
    job = _job(tmp_path, 2, ps_ranks=2, transport=transport)
    sec = {"data": 0.001, "fc0.fwd": 0.002, "fc1.fwd": 0.002, "loss.fwd": 0.001,
           "loss.bwd.softmax_loss_grad": 0.001,
           "fc1.bwd.inner_product_grad_weight": 0.002,
           "fc1.bwd.inner_product_grad_data": 0.002,
           "fc0.bwd.inner_product_grad_weight": 0.002,
           "fc0/weight.update": 0.003, "fc1/weight.update": 0.003}
    b0, b1 = 4 * 64 * 16, 4 * 16 * 64  # fc0: 16 -> 64, fc1: 64 -> 16: equal bytes
    assert b0 == b1
    link = Link(1e-4, 1e6, 0.0, "test")  # a slow link: a push (8.3 ms) > the ops after it
    add = 2e-7
    got = _predict(job, 4, sec, link, add)
    w = 2
    p = link.alpha + w * b0 / link.beta
    q = sec["fc0/weight.update"] + (w - 1) * b0 * add + p
    t1 = sum(v for k, v in sec.items() if not k.endswith(".update"))
    t2 = t1 - sec["fc1.bwd.inner_product_grad_data"] - sec["fc0.bwd.inner_product_grad_weight"]
    assert p > t1 - t2  # fc1's push still runs when fc0's is ready
    # fc1's pull (from t2 + P) ends before fc0's
    assert t2 + p + q < t1 + p + q
    assert got["iter_s"] == pytest.approx(t1 + p + q)
