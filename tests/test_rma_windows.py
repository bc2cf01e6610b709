"""Remote-memory windows (comm/windows.py): put, get, accumulate and
notify words on 2 and 3 ranks, through a shared window (one node) and an
RMA window (each rank its own emulated host), every value a closed form;
the per-pair transport choice; windows freed on every exit path."""
import pytest

from purine_mpi.base.errors import UserError
from purine_mpi.comm.windows import WindowLayout, pair_transport
from tests.mpi_scripts.launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["shared", "rma"])
def test_windows_put_get_accumulate_notify(n, kind):
    env = {"PURINE_RANKS_PER_HOST": "1"} if kind == "rma" else {}
    proc, _ = run_mpi("rma_windows.py", n, kind, 4, env=env, timeout=60)
    assert proc.stdout.count(f"OK rma_windows {kind}") == n, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # no warning of the MPI library


def test_pair_transport_choice(monkeypatch):
    monkeypatch.delenv("PURINE_RMA_ACROSS_HOSTS", raising=False)
    monkeypatch.delenv("FI_PROVIDER", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    assert pair_transport("auto", node_of, 0, 1)[0] == "shared"
    assert pair_transport("one_sided", node_of, 0, 1)[0] == "shared"
    assert pair_transport("two_sided", node_of, 0, 1)[0] == "two_sided"
    # across hosts: RMA only where the network does RDMA (or the user says so)
    kind, why = pair_transport("auto", node_of, 1, 2)
    assert kind == "two_sided" and "TCP" in why
    monkeypatch.setenv("FI_PROVIDER", "verbs;ofi_rxm")
    assert pair_transport("auto", node_of, 1, 2)[0] == "rma"
    monkeypatch.setenv("PURINE_RMA_ACROSS_HOSTS", "0")
    assert pair_transport("auto", node_of, 1, 2) == ("two_sided", "ranks on two hosts, "
                                                     "PURINE_RMA_ACROSS_HOSTS=0")
    assert pair_transport("one_sided", node_of, 1, 2)[0] == "rma"
    assert pair_transport("auto", node_of, 1, 2, rma_ok=False)[0] == "two_sided"
    # what the ranks agreed on decides over this rank's own view
    assert pair_transport("auto", node_of, 1, 2, across=(True, "every host does RDMA")) == \
        ("rma", "ranks on two hosts, every host does RDMA")
    with pytest.raises(UserError, match="parallel.transport must be one of"):
        pair_transport("rdma", node_of, 0, 1)


def test_layout_places_regions_by_node():
    layout = WindowLayout()
    layout.add("a", 0, (10,), "float32", peers=[1])
    layout.add("b", 2, (3, 3), "float64", peers=[1])
    layout.add_word("w", 1, peers=[0])
    sizes = layout.place({0: 0, 1: 0, 2: 1})
    assert layout.regions["a"].where == "shared" and layout.regions["b"].where == "rma"
    assert layout.words["w"].where == "shared"
    assert layout.regions["a"].offset == 0 and sizes[("shared", 0)] == 64
    assert sizes[("rma", 2)] == 128 and sizes[("shared", 1)] == 64
    with pytest.raises(ValueError, match="declared twice"):
        layout.add_word("a", 0)


@pytest.mark.parametrize("kind", ["shared", "rma"])
def test_put_waitwrite_release_protocols(kind):
    """Put, WaitWrite, Release and WaitFree through their kernels, under both
    release protocols (the WaitWrite releases; a Release op releases)."""
    env = {"PURINE_RANKS_PER_HOST": "1"} if kind == "rma" else {}
    proc, _ = run_mpi("rma_protocol.py", 2, kind, env=env, timeout=60)
    assert proc.stdout.count(f"OK rma_protocol {kind}") == 2, proc.stdout + proc.stderr


def test_allocate_or_fall_back_is_one_choice_for_every_transport(monkeypatch):
    """The three transport passes share one "allocate, or fall back" (comm/
    windows.allocate_or_fall_back): a library without windows gives the
    pass's fallback lines, or under ``one_sided`` an exit-2 error naming the key."""
    from purine_mpi.comm import windows
    from purine_mpi.comm.windows import WindowsUnavailable, allocate_or_fall_back

    def refuse(world, layout, node_of=None):
        raise WindowsUnavailable("no RMA here")
    monkeypatch.setattr(windows.Windows, "allocate", refuse)
    win, lines = allocate_or_fall_back(None, WindowLayout(), {}, lambda e: [("x", "y", str(e))])
    assert win is None and lines == [("x", "y", "no RMA here")]
    with pytest.raises(UserError, match="cfg.yaml: key 'parallel.transport': one_sided, but "
                                        "no RMA here; use auto or two_sided"):
        allocate_or_fall_back(None, WindowLayout(), {}, lambda e: [], refuse="cfg.yaml")
    monkeypatch.setattr(windows.Windows, "allocate", lambda world, layout, node_of=None: "W")
    assert allocate_or_fall_back(None, WindowLayout(), {}, lambda e: []) == ("W", None)
