"""A few steps of ``benchmarks/train_digits.py``: cupynce and plain PyTorch train alike.

Both runs start from the same seed and see the same augmented views, so their loss curves
differ only by the losses' rounding.  Tolerance, per step, relative:

* float64: 1e-12 — measured <= 4e-16 over 100 steps (CPU).
* float32: 1e-5 — one step's loss agrees to float32 rounding (~1e-7) and the parameters then
  differ by rounding-level amounts, which training amplifies (ReLU kinks, Adam normalising
  near-zero gradients): measured <= 1e-7 for the first 25 steps, 2e-4 by step 50 and 3e-3
  by step 100 (CPU).  Hence 20 steps, at 100x the measured difference.  (On the GPU the two
  sides use different product kernels; same bound.)
"""
from __future__ import annotations

import json
import statistics

import pytest
from bench_scripts import load

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

TOL = {"float32": 1e-5, "float64": 1e-12}
STEPS = 20


@pytest.fixture(scope="module")
def td():
    return load("train_digits")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_loss_curves_agree(td, dtype, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    res = td.run(steps=STEPS, device=device, dtype=dtype, probe=False)
    for kind, runs in res["runs"].items():
        ours, ref = runs["cupynce"]["losses"], runs["torch"]["losses"]
        assert len(ours) == len(ref) == STEPS
        diffs = [abs(a - b) / abs(b) for a, b in zip(ours, ref)]
        worst = max(range(STEPS), key=diffs.__getitem__)
        assert diffs[worst] <= TOL[dtype], (
            f"{kind} {dtype} {device}: step {worst} cupynce {ours[worst]!r} vs torch "
            f"{ref[worst]!r} (rel {diffs[worst]:.2e} > {TOL[dtype]:.0e})")
        assert statistics.mean(ours[-5:]) < ours[0]  # and it trains
        if kind == "clip":
            assert runs["cupynce"]["temperature"] == pytest.approx(runs["torch"]["temperature"],
                                                                   rel=TOL[dtype])


def test_script_writes_report(td, tmp_path):
    res = td.main(["--device", "cpu", "--steps", "6", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "train_digits_cpu.json").read_text())
    assert data["runs"].keys() == {"simclr", "clip"} and data["steps"] == 6
    for kind in ("simclr", "clip"):
        for impl in ("cupynce", "torch"):
            r = data["runs"][kind][impl]
            assert len(r["losses"]) == 6 and r["step_ms_median"] > 0
            assert 0.5 < r["probe_accuracy"]["all"] <= 1.0
    md = (tmp_path / "train_digits_cpu.md").read_text()
    assert "| SimCLR (NTXentLoss) | cupynce |" in md and "Linear-probe baselines" in md
    assert res["agreement"]["simclr"] <= TOL["float32"]
