"""``plan --choose`` and parameter servers (``parallel.mode: sync_ps``).

Every synchronous candidate (data, sharded, pipeline, tensor) says
``parallel.mode=sync``: a job of mode sync_ps does not lend them its mode.
Found: they set no mode, so under a job of ``mode: sync_ps`` the
candidate "data, recompute none" loaded as sync_ps (on the code before:
``AssertionError`` on its job's mode, ``'sync_ps' != 'sync'``), priced
and written out as parameter servers under a data-parallel label.

The parameter-server candidates: mode sync_ps with K = 1 .. N/2 servers
(``tools/choose.server_candidates``), ranked with the others; a rule of
the parameter servers (clipping with more than one server) lists the
setting as not possible with its reason; mode async is never offered."""
import pytest

from purine_mpi.tools.choose import choose
from purine_mpi.tools.plan import MemoryLimits

NET = """name: choose_ps
seed: 3
data:
  train: {source: synthetic, shape: [1, 8, 8], classes: 10, num_samples: 256, batch_size: 16}
net:
  - {type: fc, name: fc1, bottom: data, top: fc1, num_output: 256}
  - {type: relu, name: relu1, bottom: fc1, top: fc1}
  - {type: fc, name: fc2, bottom: fc1, top: fc2, num_output: 10}
  - {type: softmax_loss, name: loss, bottom: [fc2, label], top: loss}
solver: {type: sgd, base_lr: 0.01, momentum: 0.9, max_iter: 100, display: 1CLIP}
parallel: {scheme: data, mode: sync_ps, ps_ranks: 1}
"""


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    """The folder of the jobs and their calibrations (the clipping job has
    ops the other has not: a calibration file each)."""
    return tmp_path_factory.mktemp("choose_ps")


def _choice(folder, n, clip=False):
    path = folder / ("clip.yaml" if clip else "job.yaml")
    path.write_text(NET.replace("CLIP", ", clip_gradients: 5.0" if clip else ""))
    calibration = folder / ("clip_cal.json" if clip else "cal.json")
    return choose(str(path), (), n, MemoryLimits(check=False), calibration=str(calibration))


def test_synchronous_candidates_do_not_inherit_a_sync_ps_jobs_mode(cal):
    choice = _choice(cal, 2)
    evaluated = [c for c in choice.ranked if c.error is None]
    servers = [c for c in evaluated if "parallel.mode=sync_ps" in c.sets]
    others = [c for c in evaluated if c not in servers]
    assert others and servers
    for c in others:
        assert c.job.parallel.mode == "sync", (c.label, c.job.parallel.mode)
        assert "parallel.mode=sync" in c.sets
    # 2 ranks: one server, one worker (global batch 16: one worker's)
    assert [c.label for c in servers if c.variant_of is None] == \
        ["parameter servers: 1 server, 1 worker"]
    for c in servers:
        assert c.job.parallel.mode == "sync_ps" and c.job.parallel.ps_ranks == 1
        assert c.samples == 16
    data = next(c for c in others if c.label == "data, recompute none")
    assert data.samples == 32  # two replicas
    # ranked with the others by time per sample (tools/choose.rank)
    keys = [c.iter_s / c.samples for c in evaluated if c.fits]
    assert keys == sorted(keys)
    assert not any("async" in s for c in choice.ranked for s in c.sets)


def test_more_servers_are_offered_up_to_half_the_ranks_where_the_rules_allow(cal):
    """4 ranks: 1 and 2 servers; with clipping by the global norm 2
    servers are not possible (job/config.py: it needs every gradient in one
    place), named as such, while 1 server is."""
    choice = _choice(cal, 4, clip=True)
    plain = {c.label: c for c in choice.ranked if c.variant_of is None
             and "parallel.mode=sync_ps" in c.sets}
    assert sorted(plain) == ["parameter servers: 1 server, 3 workers",
                             "parameter servers: 2 servers, 2 workers"]
    one, two = plain["parameter servers: 1 server, 3 workers"], \
        plain["parameter servers: 2 servers, 2 workers"]
    assert one.error is None and one.samples == 3 * 16
    assert two.error is not None and "clip_gradients" in two.error, two.error
