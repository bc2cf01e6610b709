"""``bench --json``'s model FLOPs and MFU (tools/bench.py
``throughput_flops``) against an independent count for jobs/gpt_tiny.yaml:
per token, 6 FLOPs per weight of every matrix product (the qkv, proj, fc
and proj weights of each block and the tied lm_head) plus 12·L·C·T for
attention's q·kᵀ and P·v, forward and backward; PaLM's closed form
6N + 12·L·C·T with N every parameter but the position embedding; MFU =
FLOPs per sample x samples/s / peak.

Found: with ``recompute: full`` (or ``selective``) the count read off the
training graph included the recomputed forward ops, so the same model's
``model_flops_per_iter_sample``, achieved FLOP/s and MFU rose with
recompute (gpt_tiny: 2,949,120 -> 3,538,944 FLOPs a token with
``full``, 20 % more; with ``selective`` and unfused attention the
recomputed q·kᵀ), where model FLOPs (PaLM's MFU, tools/flops.py's own
docstring) count the forward once. On the code before: ``assert
452984832.0 == (2949120 * 128)`` (``full``) and ``assert 385875968.0 ==
(2949120 * 128)`` (``selective``, unfused)."""
import pytest

from purine_mpi.job.config import load_job
from tests.conftest import REPO

L, C, T, V, FF = 2, 128, 128, 256, 512  # jobs/gpt_tiny.yaml


def independent_per_token():
    matmul_weights = L * (3 * C * C + C * C + C * FF + FF * C) + V * C
    return 6 * matmul_weights + 12 * L * C * T


def closed_form():
    params = V * C + L * (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + C * FF + FF + FF * C
                          + C) + 2 * C  # wte, blocks (ln1, qkv, proj, ln2, fc, proj), ln_f
    return 6 * params + 12 * L * C * T


@pytest.mark.parametrize("recompute,fused", [("none", True), ("none", False), ("full", True),
                                             ("selective", False)])
def test_gpt_tiny_model_flops_and_mfu(email_h5, recompute, fused):
    from purine_mpi.tools.bench import throughput_flops
    job = load_job(f"{REPO}/jobs/gpt_tiny.yaml", overrides=[
        f"recompute={recompute}", f"data.train.path={email_h5}", f"data.test.path={email_h5}",
        f"net.3.fused={str(fused).lower()}", f"net.11.fused={str(fused).lower()}"])
    assert [layer.get("fused") for layer in job.net if layer["type"] == "attention"] == [fused] * 2
    sequences_per_s = 3.0
    result = {"images_per_s": sequences_per_s, "tokens_per_s": sequences_per_s * T}
    out = throughput_flops(job, result, places=[("h", -1, [("0", "0")])])
    assert out["model_flops_per_iter_sample"] == independent_per_token() * T
    assert out["model_flops_per_token"] == independent_per_token()
    assert out["model_flops_per_token_closed_form"] == closed_form()
    assert out["achieved_flops_per_s"] == pytest.approx(independent_per_token() * T
                                                        * sequences_per_s)
    if out["peak_flops_per_s"]:
        assert out["mfu"] == pytest.approx(out["achieved_flops_per_s"]
                                           / out["peak_flops_per_s"], rel=1e-4)
