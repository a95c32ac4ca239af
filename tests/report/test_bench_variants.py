"""CPU tests of benchmarks/bench_variants.py's formulas (the runs need a GPU; the plain PyTorch
formulas it times against must be the losses cupynce computes)."""
from __future__ import annotations

import numpy as np
import pytest
from bench_scripts import load

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    return load("bench_variants")


def test_supcon_formula_is_the_oracle(bench):
    from cupynce.reference import supcon_loss

    rng = np.random.default_rng(0)
    z, lab = rng.standard_normal((24, 5)), np.tile(np.arange(6), 4)
    t = torch.tensor(z, requires_grad=True)
    loss = bench.supcon_formula(t, torch.tensor(lab), 0.1)
    (dz,) = torch.autograd.grad(loss, [t])
    want, (wz,) = supcon_loss(z, lab, 0.1, normalize=True)
    assert abs(float(loss) - want) <= 1e-12 * abs(want)
    np.testing.assert_allclose(dz.numpy(), wz, rtol=1e-10, atol=1e-14)


def test_moco_formula_is_info_nce_without_in_batch_negatives(bench):
    import cupynce

    rng = np.random.default_rng(1)
    q, k, u = rng.standard_normal((6, 4)), rng.standard_normal((6, 4)), rng.standard_normal((9, 4))
    got = bench.moco_formula(*(torch.tensor(x) for x in (q, k, u)), 0.2)
    want = cupynce.info_nce(q, k, 0.2, negatives=u, in_batch_negatives=False, normalize=True)
    assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))


def test_clip_formula_is_clip_loss_with_labels(bench):
    import cupynce

    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
    lab = np.arange(8) // 4
    got = bench.clip_formula(torch.tensor(a), torch.tensor(b),
                             torch.tensor(1.5, dtype=torch.float64), torch.tensor(lab))
    want = cupynce.clip_loss(a, b, 1.5, labels=lab, normalize=True)
    assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))
