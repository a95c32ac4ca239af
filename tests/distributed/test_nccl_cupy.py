"""The CuPy API's ``group=`` over NCCL (``cupy.cuda.nccl.NcclCommunicator``, ``NcclComm``).

* one GPU: a one-rank communicator — the global ops equal the single-process ops, a
  ``cupyx.distributed``-style backend (an object holding ``_comm``) is unwrapped, NumPy inputs
  are refused with a clear error;
* several GPUs (``cupy.cuda.runtime.getDeviceCount() >= 2``): one process per GPU, each rank's
  loss and gradients against the single-process op on the concatenated batch.
"""
from __future__ import annotations

import traceback

import numpy as np
import pytest

import cupynce

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")


def _gpus() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


if _gpus() < 1:
    pytest.skip("needs a CUDA GPU (none here)", allow_module_level=True)


def _err(got, want) -> float:
    got, want = (np.asarray(x.get() if hasattr(x, "get") else x, np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) or 1.0))


def _cases(rank: int, P: int, n: int = 96, d: int = 64):
    """(op, global arrays, this rank's arrays, this rank's rows) for the four ops; float32
    (cuBLAS path), bfloat16 and float16 (the tiles on sm_80+)."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    N = n * P
    out = []
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        Z, A, B = ((rng.standard_normal((rows, d)) / 4).astype(dtype)
                   for rows in (2 * N, N, N))
        mine = np.r_[rank * n:(rank + 1) * n, N + rank * n:N + (rank + 1) * n]
        sl = slice(rank * n, (rank + 1) * n)
        out.append(("nt_xent", (Z,), (Z[mine],), mine))
        out.append(("info_nce", (A, B), (A[sl], B[sl]), sl))
        out.append(("clip_loss", (A, B), (A[sl], B[sl]), sl))
        out.append(("siglip_loss", (A, B), (A[sl], B[sl]), sl))
    return out


def _run(op, arrays, group):
    xs = [cp.asarray(x) for x in arrays]
    if op == "nt_xent":
        loss, ctx = cupynce.nt_xent_forward(*xs, 0.3, normalize=True, group=group)
        return loss, [cupynce.nt_xent_backward(ctx, 0.7)]
    if op == "info_nce":
        loss, ctx = cupynce.info_nce_forward(*xs, 0.2, group=group)
        return loss, list(cupynce.info_nce_backward(ctx, 0.7))
    if op == "siglip_loss":
        loss, ctx = cupynce.siglip_loss_forward(*xs, cp.asarray(np.float32(2.3)),
                                                cp.asarray(np.float32(-10.0)), normalize=True,
                                                group=group)
        return loss, list(cupynce.siglip_loss_backward(ctx, 0.7))
    loss, ctx = cupynce.clip_loss_forward(*xs, cp.asarray(np.float32(2.0)), normalize=True,
                                          group=group)
    return loss, list(cupynce.clip_loss_backward(ctx, 0.7))


def _check_ring_shift(rank: int, P: int, comm) -> None:
    """NcclComm.ring_shift: after k shifts (each with work on the current stream between its
    start and its wait) the rank holds rank (rank - k) mod P's array, bit for bit."""
    import ml_dtypes

    from cupynce.ops._comm import wrap

    ring = wrap(comm)
    assert ring.ring
    for dtype in (np.float32, ml_dtypes.bfloat16, np.int64):
        def of(r):
            return (np.arange(4096).reshape(64, 64) * 7 + 100 * r).astype(dtype)
        cur = cp.asarray(of(rank))
        for k in range(1, P + 1):
            pending = ring.ring_shift(cur)
            busy = cp.ones((2048, 2048), cp.float32) @ cp.ones((2048, 2048), cp.float32)
            cur = pending.wait()
            assert (cur.get().view(np.uint8) == of((rank - k) % P).view(np.uint8)).all(), (dtype, k)
            del busy


def _check_rank(rank: int, P: int, comm) -> None:
    _check_ring_shift(rank, P, comm)
    _check_ops(rank, P, comm)
    import cupynce.config as cfg

    with cfg.override(ring_gpu=True):  # SigLIP's, CLIP's and NT-Xent's rings on NcclComm
        _check_ops(rank, P, comm)


def _check_ops(rank: int, P: int, comm) -> None:
    for op, whole, local, rows in _cases(rank, P):
        loss, grads = _run(op, local, comm)
        want, wgrads = _run(op, whole, None)
        gtol = 1e-4 if whole[0].dtype == np.float32 else 2e-2
        assert _err(loss, want) <= 1e-5, (op, whole[0].dtype)
        for i, (g, w) in enumerate(zip(grads, wgrads)):
            if w is None:  # (info_nce without negatives)
                assert g is None
                continue
            if i >= 2:  # d logit_scale, d logit_bias: the global value on every rank
                assert _err(g, w) <= gtol, (op, i, whole[0].dtype)
            else:  # DDP's convention: P x this rank's rows of the global gradient
                assert _err(g.astype(cp.float64) / P, w[rows]) <= gtol, (op, i, whole[0].dtype)


def test_one_rank_nccl_equals_single_process():
    from cupy.cuda import nccl

    with cp.cuda.Device(0):
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        _check_rank(0, 1, comm)

        class Backend:  # what cupyx.distributed.NCCLBackend holds
            _comm = comm
        z = cp.asarray(np.random.default_rng(0).standard_normal((8, 16)), cp.float32)
        got = cupynce.nt_xent(z, 0.5, group=Backend())
        assert _err(got, cupynce.nt_xent(z, 0.5)) <= 1e-6
        with pytest.raises(ValueError, match="carries CuPy arrays only"):
            cupynce.nt_xent(z.get(), 0.5, group=comm)
        with pytest.raises(TypeError, match="group must be"):
            cupynce.nt_xent(z, 0.5, group=object())


def _worker(rank, P, uid, queue):
    try:
        from cupy.cuda import nccl

        cp.cuda.Device(rank).use()
        comm = nccl.NcclCommunicator(P, uid, rank)
        _check_rank(rank, P, comm)
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, traceback.format_exc()))


@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_nccl_one_process_per_gpu():
    import multiprocessing as mp

    from cupy.cuda import nccl

    P = _gpus()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    uid = nccl.get_unique_id()
    procs = [ctx.Process(target=_worker, args=(r, P, uid, queue)) for r in range(P)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    results = dict(queue.get() for _ in range(P))
    bad = {r: tb for r, tb in results.items() if tb}
    assert not bad, "\n".join(f"rank {r}:\n{tb}" for r, tb in bad.items())
