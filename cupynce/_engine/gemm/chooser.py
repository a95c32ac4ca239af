"""The chooser: which backend issues a row-block op's products, as a plan object the op
holds for the call (issue 24: CLIP's, SigLIP's, InfoNCE's and a global NT-Xent's float32
score and gradient products at tensor-core speed with fp32 accuracy).

The row blocks (``losses.row_blocks``) compute each score block and its gradient accumulators
with three kinds of product: S = A Bᵀ (the scores), dA = G B and dB = Gᵀ A (G, the gradient
block, written over S).  :func:`plan` gives the op the :class:`Plan` to issue them with:
under the float32 precision "auto" from ``config.tf32x3_min_rows`` rows and
``config.tf32x3_min_dim`` columns (``tf32x3_min_dim_scale`` for CLIP and SigLIP, whose scale
gradient sets it) on (and under "3xtf32" at every size) on a Hopper GPU, a
:class:`TilesPlan` -- ``tf32x3.mm``, both operands split to TF32 hi + lo, three TF32 products
per 32 of K promoted to an fp32 register sum (as accurate as fp32 or more: docs/design.md),
or under "auto" the F16x3 tiles (``f16x3.mm``, ``config.f16x3``) --, else :data:`CUBLAS`
(``cublas.gemm``, as before).  Every plan has :func:`cublas.gemm`'s ``gemm`` signature and
says what the op plans around it (:meth:`Plan.split_row_bytes`, :meth:`Plan.side_splits`).

TF32 wgmma reads both operands K-major (rows of K contiguous).  A Bᵀ reads A and B as they
are stored; G B reads G and Bᵀ split (``tf32x3.split_t``: one kernel, no copy); Gᵀ A
reads G as stored through the ``mmt`` kernel (32 x 32 boxes of G transposed by its
consumers in shared memory: G is not copied or changed) and Aᵀ split likewise.  What the
tiles cannot take runs through cuBLAS in true fp32 (accurate; no split scratch the planner
did not count): operands or outputs without 16-byte rows (D or the block's width not a
multiple of 4: no copy is made), ``beta`` other than 0 or 1, and a launch the tiles refuse
(``tf32x3.TF32TilesUnavailable``).  Products small enough for ``cublas.gemm``'s
``small_gemm`` route (``config.small_gemm_macs``) take it, in fp32, as in every mode.

Scratch, from CuPy's pool and outside ``workspace_bytes`` (which bounds the N x N-sized
blocks; NT-Xent's tiles likewise split z outside it): the operand each product splits, one
at a time -- B (Nc x D: its hi / lo halves, 2 x its size) for A Bᵀ, Bᵀ's halves (2 x) for
G B, of the block's A rows (2 x rows x D) for Gᵀ A; no copy or split of S or G (the
row-block planners count none: :meth:`Plan.split_row_bytes`).  B is split again for every row
block and pass (no cache: a cached split would hold 2-4 x B between passes).  Where one
block holds the whole problem, CLIP and SigLIP split both gradient operands (Bᵀ and Aᵀ) on a
side stream while the score product runs (:meth:`TilesPlan.mark` / :meth:`TilesPlan.prefetch`,
on the SMs S's grid leaves free): both splits are then held at once, from before the score
product to the gradient products (4 x D x (N + Nc) bytes more at the peak: 64 MiB at
N = Nc = 16384, D = 512).  Their memory is allocated on the current stream before an event
the side stream waits for, and the current stream waits for the splits before the product
that reads them (or, unread, before they are freed: :meth:`TilesPlan.settle`): stream-ordered
for CuPy's pool and for torch's caching allocator alike (``cupynce.torch`` allocates through
it on torch's stream).  Not under a stream capture, nor in a CUDA-graph probe of
``ops._graphs`` (:func:`same_stream`: the probe and the capture must allocate alike).
Deterministic: fixed orders throughout; the accumulating products read-add-store each element
once.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import numpy as np

from ... import config
from ..arrays import leading_dim
from . import cublas, f16x3, tf32x3

# ``config.tf32x3_min_dim_scale``: "auto" takes the tiles from this many columns D on (and
# ``tf32x3_min_rows`` rows) for the ops with a learnable scale (CLIP, SigLIP;
# ``tf32x3_min_dim`` for the others).  Measured on an H100 (the precision tests' bar,
# 2026-11-26): the per-row losses and feature gradients of CLIP, SigLIP and InfoNCE were at
# least as accurate as fp32's at every shape measured (N x D = 4096 x 64 / 128 / 256 / 512,
# 8192 x 128, 6144 x 256), InfoNCE's everything; the scalar gradient dlogit_scale (reduction
# "none", rms over four draws) was not at D <= 256: CLIP 8.9e-7 against fp32's 1.5e-7
# (4096 x 64), 1.5e-6 against 2.9e-7 (8192 x 128), 2.6e-6 against 4.8e-7 (4096 x 256;
# 6144 x 256 passed), SigLIP 4.1e-7 against 1.3e-7 (4096 x 64).  Both paths' dlogit_scale is
# far from what exactly rounded scores give (3e-8 against up to 4.6e-6 for fp32 at
# 4096 x 512: the sum amplifies the scores' errors), so the comparison is noisy; 512 is the
# smallest D where it held for both.  ``tf32x3_min_dim`` (InfoNCE, a global NT-Xent's rank
# blocks) is NT-Xent's (``losses.nt_xent_tf32``).


def applies(a_rows, b_rows, scale_grad: bool = False) -> bool:
    """Whether the products of a score block between the float32 rows ``a_rows`` (n, d) and
    ``b_rows`` (nc, d) go to the TF32x3 tiles: the float32 precision in effect "3xtf32", or
    "auto" with n and nc at least ``config.tf32x3_min_rows`` and d at least
    ``tf32x3_min_dim`` (``tf32x3_min_dim_scale`` for an op with a scale gradient,
    ``scale_grad``; below, not measured as accurate as fp32), a Hopper GPU with tensor maps
    and the tiles not switched off (``config.tiles``, ``CUPYNCE_TILES=0``)."""
    cfg = config.current()
    if cfg.tiles is False or a_rows.dtype != np.float32 or b_rows.dtype != np.float32:
        return False
    mode = cfg.float32_precision
    if mode == "auto":
        n, d = a_rows.shape
        min_dim = cfg.tf32x3_min_dim_scale if scale_grad else cfg.tf32x3_min_dim
        if min(n, b_rows.shape[0]) < cfg.tf32x3_min_rows or d < min_dim:
            return False
    elif mode != "3xtf32":
        return False
    return tf32x3.available()


def f16_applies() -> bool:
    """Whether "auto"'s products take the F16x3 tiles (``config.f16x3``, the float32
    precision in effect "auto", the tiles available)."""
    cfg = config.current()
    return cfg.f16x3 and cfg.float32_precision == "auto" and f16x3.available()


class Plan:
    """How one op call issues its products: :meth:`gemm` (``cublas.gemm``'s signature) and
    what the op plans around it.  :data:`CUBLAS` (stateless, shared) or a :class:`TilesPlan`
    (one per call: it holds the call's prefetched splits)."""

    #: the products run on the TF32x3 / F16x3 tiles (no split of the gradient block to plan)
    tiles = False
    #: the score products on the F16x3 tiles
    f16 = False
    #: the gradient products too (the op writes G as F16x3 halves: CLIP; set by it)
    grad_f16 = False

    def gemm(self, a, b, out, *, trans_a: bool = False, trans_b: bool = False,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        """``out = alpha · op(a) op(b) + beta · out``: :func:`cublas.gemm` (looked up at the
        call: tests replace it)."""
        cublas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)

    def split_row_bytes(self, dtype, cols: int) -> int:
        """Scratch bytes per row of a block whose products this plan issues:
        :func:`cublas.split_row_bytes` (the "3xtf32" split of the gradient block) on cuBLAS,
        0 on the tiles (they split in shared memory)."""
        return 0 if self.tiles else cublas.split_row_bytes(dtype, cols)

    def side_splits(self, want_grad: bool, one_block: bool) -> bool:
        """Whether a CLIP / SigLIP call splits its gradient products' operands beside the
        score product: ``config.side_splits``, it wants the gradient, one row block holds the
        whole problem (the splits serve its one pair of gradient products) and the products
        are the tiles'."""
        return (self.tiles and want_grad and one_block and config.current().side_splits)


#: the cuBLAS plan (also what an op that never takes the tiles issues with)
CUBLAS = Plan()


def plan(a_rows, b_rows, scale_grad: bool = False) -> Plan:
    """The products of a row-block op over ``a_rows`` x ``b_rows``: a :class:`TilesPlan`
    where :func:`applies` (on the F16x3 tiles where :func:`f16_applies`), else
    :data:`CUBLAS`."""
    if not applies(a_rows, b_rows, scale_grad):
        return CUBLAS
    return TilesPlan(f16=f16_applies())


def _rows16(x) -> bool:
    """float32 with 16-byte rows (unit column stride, leading dimension a multiple of 4,
    16-byte aligned): what a tensor map of the tiles reads."""
    return (x.dtype == np.float32 and x.ndim == 2 and x.strides[1] == 4
            and leading_dim(x) % 4 == 0 and x.data.ptr % 16 == 0)


def _out_ok(out) -> bool:
    """The product tile's stores: float32, unit column stride, an even leading dimension."""
    return (out.dtype == np.float32 and out.strides[1] == 4 and leading_dim(out) % 2 == 0
            and out.data.ptr % 8 == 0)


_tls = threading.local()


@contextlib.contextmanager
def same_stream() -> Iterator[None]:
    """No side-stream splits in this thread while inside (:meth:`TilesPlan.mark` gives None):
    ``ops._graphs`` probes and captures a plan in it, which must allocate the same buffers in
    the same order (a capture never takes them)."""
    before = getattr(_tls, "same", False)
    _tls.same = True
    try:
        yield
    finally:
        _tls.same = before


_side_streams: dict = {}


def _side_stream(device: int):
    """This process's non-blocking side stream on ``device`` (made once)."""
    import cupy as cp

    st = _side_streams.get(device)
    if st is None:
        st = _side_streams.setdefault(device, cp.cuda.Stream(non_blocking=True))
    return st


def _key(x) -> tuple:
    return (x.data.ptr, x.shape, x.strides)


class TilesPlan(Plan):
    """The TF32x3 (F16x3) products of one row-block op call (see the module doc)."""

    tiles = True

    def __init__(self, f16: bool = False):
        # _key(b) -> (the split_t halves of b, [the side stream's event after them, whether
        # the allocating stream waits for it already]: one list for the splits of one
        # prefetch); the allocating stream
        self._ready: dict = {}
        self._stream = None
        #: the score products on the F16x3 tiles (``f16x3``) instead of the TF32x3 ones
        self.f16 = f16
        #: the gradient products too (the op writes G as F16x3 halves: CLIP; set by it): the
        #: splits of their B operands are then F16x3's
        self.grad_f16 = False
        # _key(G) -> the device factor of a gradient block written as F16x3 halves
        self._grad: dict = {}

    def set_grad_block(self, g, ufac) -> None:
        """``g`` (rows, cols) float32 now holds a gradient block's F16x3 halves interleaved in
        place (``cpn_clip_grad_f16x3``), every product of it times the device scalar
        ``ufac``: :meth:`gemm` reads it so (it is no longer float32 values)."""
        self._grad[_key(g)] = ufac

    def mark(self, *bs):
        """Before the score product: the halves of ``split_t(b)`` for each of ``bs`` (the B
        operands of G B and Gᵀ A: B and A), allocated on the current stream, and an event
        recorded on it after them -- for :meth:`prefetch`, called once that product is
        issued.  None (nothing done) inside :func:`same_stream`, while the current stream is
        being captured, or where no operand qualifies (float32, 2-D, unit column stride,
        not empty); an operand given twice (B is A) is split once."""
        import cupy as cp


        if getattr(_tls, "same", False):
            return None
        cur = cp.cuda.get_current_stream()
        try:
            if cur.is_capturing():
                return None
        except Exception:  # noqa: BLE001 - (the legacy stream while another captures)
            return None
        todo, seen = [], set()
        for b in bs:
            k = _key(b)
            if (b.dtype == np.float32 and b.ndim == 2 and b.size and b.strides[1] == 4
                    and k not in seen and k not in self._ready):
                seen.add(k)
                if self.grad_f16:
                    d, rows = b.shape[1], -(-b.shape[0] // 8) * 8
                    todo.append((b, (cp.empty((d, rows), np.float16),
                                     cp.empty((d, rows), np.float16),
                                     cp.empty(d, np.float32), cp.empty(d, np.uint32))))
                else:
                    shape = tf32x3.split_t_shape(b)
                    todo.append((b, (cp.empty(shape, np.float32),
                                     cp.empty(shape, np.float32))))
        if not todo:
            return None
        self._stream = cur
        after = cp.cuda.Event(disable_timing=True)
        after.record(cur)
        return todo, after

    def prefetch(self, pre) -> None:
        """Split the operands of :meth:`mark`'s ``pre`` into its halves on the side stream,
        after its event (so beside the product issued since); the product that takes a
        split first makes the current stream wait for it (:meth:`_split_t`).  None: nothing
        to do."""
        import cupy as cp


        if pre is None:
            return
        todo, after = pre
        side = _side_stream(cp.cuda.runtime.getDevice())
        side.wait_event(after)
        state = [None, False]
        try:
            with side:
                for b, out in todo:
                    # (registered before its launch: a launch that raises leaves the splits
                    # already queued to settle(), which waits for them before their memory
                    # goes back)
                    self._ready[_key(b)] = (out, state)
                    if self.grad_f16:
                        f16x3.split_cols_t(b, "b", out=out)
                    else:
                        tf32x3.split_t(b, "b", out=out)
        finally:
            done = cp.cuda.Event(disable_timing=True)
            done.record(side)
            state[0] = done

    def _split_t(self, b):
        """``tf32x3.split_t(b)``: :meth:`prefetch`'s where there is one (the current
        stream made to wait for it, once)."""
        import cupy as cp


        got = self._ready.get(_key(b))
        if got is None:
            if self.grad_f16:

                return f16x3.split_cols_t(b, "b")
            return tf32x3.split_t(b, "b")
        out, state = got
        if not state[1]:
            cp.cuda.get_current_stream().wait_event(state[0])
            state[1] = True
        return out[:3] if self.grad_f16 else out

    def settle(self) -> None:
        """Drop the prefetched splits, the allocating stream first made to wait for any not
        yet waited for (their memory then goes back to the pool in that stream's order, after
        the side stream's writes).  Called at the end of the op; :meth:`__del__` too, for an
        op left by an exception."""
        ready, self._ready = self._ready, {}
        st = self._stream
        for state in {id(v[1]): v[1] for v in ready.values()}.values():
            if not state[1] and st is not None and state[0] is not None:
                try:
                    st.wait_event(state[0])
                except Exception:  # noqa: BLE001 - (a stream being captured: nothing added)
                    pass

    def __del__(self):
        try:
            if self._ready:
                self.settle()
        except Exception:  # noqa: BLE001 - (interpreter shutdown)
            pass

    def gemm(self, a, b, out, *, trans_a: bool = False, trans_b: bool = False,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        """``out = alpha · op(a) op(b) + beta · out`` (``beta`` 1: each element accumulated
        once, in a fixed order).  Products the tiles cannot take go to cuBLAS in true fp32."""

        m, n = out.shape
        if m == 0 or n == 0:
            return
        if self._grad:
            ufac = self._grad.get(_key(a))
            if ufac is not None:  # (F16x3 halves: only those tiles can read it)
                self._grad_product(a, b, out, ufac, trans_a, trans_b, alpha, beta)
                return
        small = cublas.small_product(m, n, a.shape[0] if trans_a else a.shape[1])
        if (self.f16 and not small and trans_b and not trans_a and beta in (0.0, 1.0)
                and a.dtype == np.float32 and b.dtype == np.float32 and _out_ok(out)):

            (ah, al, ia), (bh, bl, ib) = (f16x3.split_rows(a, "a"),
                                          f16x3.split_rows(b, "b"))
            f16x3.mm((ah, al), (bh, bl), out, alpha, rowf=ia, colf=ib,
                           accumulate=beta == 1.0, k=a.shape[1])
            return
        ok = (not small and beta in (0.0, 1.0) and not (trans_a and trans_b) and _out_ok(out)
              and a.dtype == np.float32 and b.dtype == np.float32)
        if ok and _rows16(a):
            parts = tf32x3.split(b, "b") if trans_b else self._split_t(b)
            try:
                # (dA = G·B: a row block's few output tiles over K = N, the one product
                # of long K and a small output; it may run K-split, tf32x3.k_splits)
                tf32x3.mm(a, parts, out, alpha, accumulate=beta == 1.0, trans_a=trans_a,
                          k_split=not trans_a and not trans_b)
                return
            except tf32x3.TF32TilesUnavailable:
                pass  # (a launch the tiles refused: cuBLAS fp32, below)
        with config.float32_precision("fp32"):
            cublas.gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)

    def _grad_product(self, g, b, out, ufac, trans_a: bool, trans_b: bool, alpha: float,
                      beta: float) -> None:
        """G B (``trans_a``: Gᵀ B) of a gradient block ``g`` written as F16x3 halves
        (:meth:`set_grad_block`): B split per column (``f16x3.split_cols_t``, or the
        side stream's), the halves read in place."""

        if trans_b or beta not in (0.0, 1.0):
            raise ValueError(f"TilesPlan: a gradient block in F16x3 halves takes G B or Gᵀ B "
                             f"with beta 0 or 1, not trans_b={trans_b}, beta={beta}")
        rows, cols = g.shape
        bh, bl, inv = self._split_t(b)
        f16x3.mm(f16x3.Interleaved(g, rows, cols), (bh, bl), out, alpha,
                       colf=inv, ufac=ufac, trans_a=trans_a, accumulate=beta == 1.0,
                       k=rows if trans_a else cols)
