"""The global losses over torch.distributed on GPUs (the checks of test_distributed_cpu.py on
CUDA tensors, float64 / float32 on the cuBLAS path and bfloat16 on the tile kernels).

* one GPU: gloo with 2 processes sharing the GPU (NCCL refuses two ranks on one device), and
  NCCL with one process (its reduce-scatter path);
* several GPUs: NCCL, one process per GPU, where ``torch.cuda.device_count() >= 2``.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import test_torch_distributed as D  # noqa: E402  (its folder is on sys.path: conftest)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]

CHECKS = ["check_nt_xent", "check_info_nce", "check_clip_loss", "check_siglip_loss",
          "check_ddp_step"]


def test_gloo_two_ranks_on_one_gpu():
    D.run_ranks(2, CHECKS + ["check_mismatched_sizes_raise", "check_bad_inputs_raise_everywhere"],
                backend="gloo", device="cuda")


def test_nccl_one_rank():
    D.run_ranks(1, CHECKS, backend="nccl", device="cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_one_rank_per_gpu():
    D.run_ranks(torch.cuda.device_count(),
                CHECKS + ["check_mismatched_sizes_raise", "check_bad_inputs_raise_everywhere"],
                backend="nccl", device="cuda")
