"""Big contrastive batches on small memory: gradient caching (GradCache, Gao et al. 2021,
"Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", arXiv:2101.06983)
around a fused loss.

A contrastive batch of 65536 pairs runs out of memory in the encoder's activations, not in the
loss. :class:`GradientCache` splits the encoder's work into chunks and keeps one chunk's
activations alive at a time::

    cache = cupynce.torch.GradientCache(model, lambda q, p: ct.info_nce(q, p, 0.05),
                                        chunk_size=1024)
    with torch.autocast("cuda", torch.bfloat16):
        loss = cache(queries, documents)      # (i) + (ii)
    scaler.scale(loss).backward()             # (iii)
    scaler.step(optimizer)

(i) every column of the batch is embedded chunk by chunk without a graph (``torch.no_grad``),
each chunk's CPU and CUDA random state saved; (ii) the loss runs once over the whole batch of
embeddings — with cupynce's fused losses that one call also computes the embeddings' gradients
(``reduction`` "mean" / "sum"), and what it keeps for the backward is O(N·D), never N × N;
it runs without CUDA-graph replay (``config.scope(graphs=False)``: once a step, a graph's
memory pool would cost more than its replay saves);
(iii) the loss's ``backward()`` re-embeds each chunk with a graph under the saved random state
(dropout draws the same masks) and the autocast state of step (i), whoever calls it, and
backpropagates the chunk's rows of the embeddings' gradient, times the upstream gradient
(so ``GradScaler``'s scale and a division for accumulation reach every chunk). The returned
loss is the step's loss, and every other tensor the loss function used (a learnable
``logit_scale``) gets its gradient from the same backward.

Memory: the encoder's activations of one chunk, the (N, D) embeddings of every column (twice
during the backward: the embeddings and their gradient), and what the loss keeps. Time: one
extra forward of the encoder over the batch (the price of caching), the loss once.

Across processes: give the loss ``group=`` (``cupynce.torch.info_nce(..., group=g)``: every
rank's rows against every rank's) and this helper the same ``group``. Under
``DistributedDataParallel`` the parameter gradients are all-reduced once per step: every chunk
but the last one backpropagated runs under the module's ``no_sync()`` (the DDP modules among
the encoders are found; pass others with ``ddp=``), so after DDP's average they equal one
process's gradients on the whole global batch (cupynce's global losses return P times a
rank's share of the gradient for that average: ``cupynce.torch.distributed``). Each DDP module
synchronises at its own last chunk (two towers, two modules: each once). With ``group``, every
rank's argument checks, then every rank's first pass (an encoder's error, an out-of-memory
included), are agreed in two small collectives before the loss runs collectives of its own,
so that one rank's bad input raises on every rank instead of leaving the others waiting (the
ranks may chunk differently: token budgets). Not supported yet, and refused:
``DistributedDataParallel(static_graph=True)``; a DDP module whose last chunk needs no
gradient (a frozen route). Columns the loss does not use are refused at the call.

The chunks: rows ``[k·chunk_size, (k+1)·chunk_size)`` of every column, or the caller's
``ranges`` (sentence-transformers' token budgets). A dict column is sliced tensor by tensor
along dim 0 (other values pass as they are); where it holds a 2-D ``attention_mask``, the
trailing positions that are padding for the whole chunk are dropped from every tensor of that
sequence width, as sentence-transformers does (a chunk of short texts is not embedded at the
batch's width). Finding those widths reads the rows' last positions to the host once per
column and call, before the first chunk; the backward reuses them and synchronises nothing.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import get_device_states, set_device_states

from .. import config

__all__ = ["GradientCache"]

Column = Union[Tensor, Dict[str, Any]]
Ranges = Sequence[Tuple[int, int]]


def _loss_scope():
    """The scope the loss runs in: no CUDA-graph replay.  The loss runs once a step, over the
    whole batch: a graph would save microseconds of a step of seconds, and its memory pool
    would stay through the next step (0.39 GiB at N = 8192, D = 384: docs/results.md)."""
    return config.scope(graphs=False)


class _RandomState:
    """The CPU and CUDA generators' states when a chunk was first embedded (the devices of the
    chunk's tensors and the current CUDA device): :meth:`replay` runs a block under them and
    leaves the caller's generators as they were."""

    def __init__(self, tensors: Sequence[Tensor]):
        self.cpu = torch.get_rng_state()
        extra = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            extra.append(torch.empty(0, device=torch.device("cuda", torch.cuda.current_device())))
        self.devices, self.states = get_device_states(*tensors, *extra)

    @contextlib.contextmanager
    def replay(self):
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.states)
            yield


def _autocast_state() -> List[Tuple[str, bool, torch.dtype]]:
    """(device type, enabled, dtype) of autocast for CPU and CUDA, as the caller runs."""
    out = []
    for dev in ("cpu", "cuda"):
        if hasattr(torch, "get_autocast_dtype"):  # (torch >= 2.4)
            out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        elif dev == "cuda":
            out.append((dev, torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()))
        else:
            out.append((dev, torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()))
    return out


@contextlib.contextmanager
def _under(state: List[Tuple[str, bool, torch.dtype]]):
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state:
            if dev == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
        yield


def _rows(op: str, column: Column, index: int) -> int:
    """The batch size of a column (a tensor's first dimension; a dict's tensors')."""
    if isinstance(column, Tensor):
        if column.dim() < 1:
            raise ValueError(f"{op}: column {index} is a 0-d tensor; expected a batch along "
                             "dim 0")
        return column.shape[0]
    if isinstance(column, dict):
        sizes = {k: v.shape[0] for k, v in column.items()
                 if isinstance(v, Tensor) and v.dim() > 0}
        if not sizes:
            raise TypeError(f"{op}: column {index} is a dict without tensors (keys "
                            f"{sorted(map(str, column))}); expected tensors with the batch "
                            "along dim 0")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"{op}: column {index}'s tensors disagree on the batch size: "
                             f"{sizes}")
        return next(iter(sizes.values()))
    raise TypeError(f"{op}: column {index} is a {type(column).__name__}; expected a tensor or "
                    "a dict of tensors (the batch along dim 0)")


def _widths(column: Column, spans: Ranges) -> Optional[List[int]]:
    """For a dict column with a 2-D ``attention_mask``: every chunk's width, its last used
    position + 1 (the full width where a chunk uses none); else None. One host read of the
    rows' last positions per column and call, none per chunk: the replay reuses them."""
    mask = column.get("attention_mask") if isinstance(column, dict) else None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[1] == 0:
        return None
    width = mask.shape[1]
    pos = torch.arange(1, width + 1, device=mask.device)
    last = torch.where(mask != 0, pos, 0).amax(dim=1).tolist()  # (the one synchronisation)
    return [max(last[b:e], default=0) or width for b, e in spans]


def _slice(column: Column, begin: int, end: int, keep: Optional[int] = None) -> Column:
    """Rows begin:end of a column; a dict's tensors of the mask's width cut to ``keep``
    positions (see the module docstring)."""
    if isinstance(column, Tensor):
        return column[begin:end]
    mask = column.get("attention_mask")
    width = mask.shape[1] if isinstance(mask, Tensor) and mask.dim() == 2 else None
    out = {}
    for key, value in column.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            out[key] = value
        elif keep is not None and keep < width and value.dim() >= 2 and value.shape[1] == width:
            out[key] = value[begin:end, :keep]
        else:
            out[key] = value[begin:end]
    return out


def _tensors(chunk: Column) -> List[Tensor]:
    return [chunk] if isinstance(chunk, Tensor) else \
        [v for v in chunk.values() if isinstance(v, Tensor)]


class _Step:
    """One call's cache: the columns, their chunks' random states and the autocast state, for
    the backward's re-embedding; shared by the columns' :class:`_Replay` nodes.

    DDP: every module's all-reduce belongs to its own last chunk. ``left[m]`` counts the chunks
    still to backpropagate through module m in this backward pass (the columns arrive in
    autograd's order); the chunk that takes it to 0 runs outside ``no_sync`` and restores the
    count, so a second backward (``retain_graph=True``) synchronises again. Counters change
    under a lock (autograd may run two devices' nodes on two threads)."""

    def __init__(self, owner: "GradientCache", encoders, columns, ranges, widths, states,
                 autocast, shapes):
        self.owner, self.encoders, self.columns, self.ranges = owner, encoders, columns, ranges
        self.widths, self.states, self.autocast = widths, states, autocast
        self.shapes: List[List[torch.Size]] = shapes  # (the first pass's, per chunk)
        self.ddp = [owner.ddp_of(e) for e in encoders]
        self.total: Dict[int, int] = {}
        for i, mods in enumerate(self.ddp):
            for m in mods:
                self.total[id(m)] = self.total.get(id(m), 0) + len(ranges[i])
        self.left = dict(self.total)
        self.lock = threading.Lock()

    def _unsynced(self, index: int) -> List[DistributedDataParallel]:
        """The modules of column ``index`` whose all-reduce is not this chunk's."""
        out = []
        with self.lock:
            for m in self.ddp[index]:
                self.left[id(m)] -= 1
                if self.left[id(m)] == 0:
                    self.left[id(m)] = self.total[id(m)]
                else:
                    out.append(m)
        return out

    def backward(self, index: int, grad: Tensor) -> None:
        """Re-embed column ``index`` chunk by chunk and backpropagate ``grad``'s rows."""
        encoder = self.encoders[index]
        with torch.enable_grad(), _under(self.autocast):
            for k, (begin, end) in enumerate(self.ranges[index]):
                quiet = self._unsynced(index)
                syncs = [m for m in self.ddp[index] if m not in quiet]
                with contextlib.ExitStack() as stack:
                    for module in quiet:  # (the forward too: DDP prepares its reducer there)
                        stack.enter_context(module.no_sync())
                    keep = self.widths[index][k] if self.widths[index] else None
                    with self.states[index][k].replay():
                        out = encoder(_slice(self.columns[index], begin, end, keep))
                    if not isinstance(out, Tensor) or out.shape != self.shapes[index][k]:
                        raise RuntimeError(
                            f"GradientCache: column {index}, chunk {k}: the re-embedding gave "
                            f"{_describe(out)} where the first pass gave "
                            f"{tuple(self.shapes[index][k])} (a non-deterministic encoder?)")
                    if out.requires_grad:
                        torch.autograd.backward(out, grad[begin:end].to(out.dtype))
                    elif syncs:
                        raise RuntimeError(
                            f"GradientCache: column {index}, chunk {k} carries the "
                            "DistributedDataParallel all-reduce but its embeddings need no "
                            "gradient (a frozen route of the model?): not supported yet")


def _unreached(loss: Tensor, tracked: Sequence[Tensor]) -> List[int]:
    """The columns whose replay node the loss's graph does not reach."""
    want = {t.grad_fn: i for i, t in enumerate(tracked)}
    seen, todo = set(), [loss.grad_fn]
    while todo and len(seen & want.keys()) < len(want):
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(f for f, _ in node.next_functions)
    return sorted(i for node, i in want.items() if node not in seen)


def _describe(out: Any) -> str:
    return f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__


class _Replay(torch.autograd.Function):
    """Identity on a column's embeddings, whose backward runs the re-embedding (step iii)."""

    @staticmethod
    def forward(ctx, token: Tensor, emb: Tensor, step: _Step, index: int) -> Tensor:
        ctx.step, ctx.index = step, index
        return emb.view_as(emb)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("GradientCache: double backward (create_graph=True) is not "
                               "supported")
        ctx.step.backward(ctx.index, grad)
        return None, None, None, None


class GradientCache:
    """A loss over big batches whose encoders run in chunks (module docstring).

    Parameters
    ----------
    encoders : nn.Module or callable, or a sequence of them
        One encoder for every column, or one per column. Each takes a chunk of its column (a
        tensor, or a dict of tensors) and returns a 2-D tensor (chunk rows, D).
    loss_fn : callable
        ``loss_fn(*embeddings) -> scalar tensor``, embeddings (N, D) per column in column order:
        a cupynce loss (``lambda q, p: cupynce.torch.info_nce(q, p, 0.05)``), a module such as
        :class:`cupynce.torch.ClipLoss`, or any callable. (A plain-PyTorch loss works but keeps
        its own graph, N × N logits included, until the backward.)
    chunk_size : int > 0
        Rows per chunk of the encoders' passes.
    group : torch.distributed process group, optional
        The ranks the loss spans (the same ``group=`` as the loss's): their inputs are compared
        before any collective runs (module docstring). None: no comparison.
    ddp : sequence of DistributedDataParallel, optional
        DDP modules the encoders run that are not themselves encoders (e.g. an encoder
        ``lambda f: ddp_model(f)["sentence_embedding"]``): their gradients are all-reduced
        once, at the last chunk. DDP modules given as encoders are found.
    progress : bool
        A tqdm bar over the first pass's chunks (tqdm: the ``report`` extra, or
        sentence-transformers' own dependency).

    Calling ``cache(*columns, ranges=None)`` returns the loss; ``ranges`` (one list of
    ``(begin, end)`` row ranges per column, covering it in order) replaces the chunks of
    ``chunk_size`` rows. With grad mode off (evaluation) the columns are embedded in chunks
    and the loss returned, nothing saved.
    """

    def __init__(self, encoders: Union[Callable, Sequence[Callable]], loss_fn: Callable,
                 chunk_size: int, *, group: Optional[Any] = None,
                 ddp: Sequence[DistributedDataParallel] = (), progress: bool = False):
        op = "GradientCache"
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"{op}: chunk_size must be an int >= 1, got {chunk_size!r}")
        many = isinstance(encoders, (list, tuple, nn.ModuleList))
        for e in (encoders if many else [encoders]):
            if not callable(e):
                raise TypeError(f"{op}: an encoder must be an nn.Module or a callable, got "
                                f"{type(e).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"{op}: loss_fn must be callable, got {type(loss_fn).__name__}")
        for m in ddp:
            if not isinstance(m, DistributedDataParallel):
                raise TypeError(f"{op}: ddp= takes DistributedDataParallel modules, got "
                                f"{type(m).__name__}")
        self._encoders = list(encoders) if many else encoders
        self.loss_fn, self.chunk_size, self.group = loss_fn, chunk_size, group
        self.ddp, self.progress = tuple(ddp), progress

    def ddp_of(self, encoder: Callable) -> List[DistributedDataParallel]:
        """The DDP modules whose all-reduce an encoder's backward triggers."""
        found = [encoder] if isinstance(encoder, DistributedDataParallel) else []
        return found + [m for m in self.ddp if m is not encoder]

    def _agree(self, local: Any) -> List[Any]:
        """Every rank's ``local`` (a small all-gather over ``group``)."""
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, local, group=self.group)
        return out

    def _check(self, columns, ranges) -> List[List[Tuple[int, int]]]:
        """The columns' chunk ranges; ``ValueError`` / ``TypeError`` naming what is wrong
        (on every rank of ``group``)."""
        op = "GradientCache"
        error, spans = None, []
        try:
            if not columns:
                raise ValueError(f"{op}: no columns given; expected at least one")
            if isinstance(self._encoders, list) and len(self._encoders) != len(columns):
                raise ValueError(f"{op}: {len(self._encoders)} encoders for {len(columns)} "
                                 "columns; expected one encoder, or one per column")
            sizes = [_rows(op, c, i) for i, c in enumerate(columns)]
            for i, c in enumerate(columns):
                if any(t.requires_grad and t.grad_fn is not None for t in _tensors(c)):
                    raise ValueError(
                        f"{op}: column {i} carries a graph (it requires grad and is not a "
                        "leaf); its chunks are re-embedded in the backward, which would run "
                        "that graph once a chunk: pass it detached, or make the step that "
                        "produced it part of the encoder")
            for m in self.ddp + tuple(e for e in (self._encoders if isinstance(
                    self._encoders, list) else [self._encoders])
                    if isinstance(e, DistributedDataParallel)):
                if getattr(m, "static_graph", False):
                    raise NotImplementedError(
                        f"{op}: DistributedDataParallel(static_graph=True) is not supported "
                        "yet (the chunks run a different graph each); use static_graph=False")
            if sizes and sizes[0] == 0:
                raise ValueError(f"{op}: the batch is empty (0 rows); expected at least one")
            if len(set(sizes)) > 1:
                raise ValueError(f"{op}: the columns have different batch sizes {sizes}; "
                                 "expected one size (row i of every column is one example)")
            if ranges is None:
                spans = [[(b, min(b + self.chunk_size, n)) for b in range(0, n, self.chunk_size)]
                         for n in sizes]
            else:
                if len(ranges) != len(columns):
                    raise ValueError(f"{op}: ranges has {len(ranges)} entries for "
                                     f"{len(columns)} columns; expected one list per column")
                spans = [[(int(b), int(e)) for b, e in r] for r in ranges]
                for i, (r, n) in enumerate(zip(spans, sizes)):
                    at = 0
                    for b, e in r:
                        if b != at or e <= b:
                            raise ValueError(f"{op}: ranges[{i}] = {r!r} must cover rows "
                                             f"0..{n} in order with non-empty ranges")
                        at = e
                    if at != n:
                        raise ValueError(f"{op}: ranges[{i}] = {r!r} must cover rows 0..{n} "
                                         "in order with non-empty ranges")
        except (TypeError, ValueError, NotImplementedError) as exc:
            error = exc
        self._raise_everywhere(error, "failed its checks")
        return spans

    def _raise_everywhere(self, error: Optional[BaseException], what: str) -> None:
        """Raise ``error`` here and, with ``group``, every rank's first error on the others
        (one small all-gather), so that no rank is left waiting in a later collective."""
        if self.group is not None:
            everyone = self._agree(None if error is None else repr(error))
            bad = [(rank, msg) for rank, msg in enumerate(everyone) if msg]
            if error is None and bad:
                raise ValueError(f"GradientCache: rank {bad[0][0]} {what}: {bad[0][1]}")
        if error is not None:
            raise error

    def __call__(self, *columns: Column, ranges: Optional[Sequence[Ranges]] = None) -> Tensor:
        spans = self._check(columns, ranges)
        encoders = self._encoders if isinstance(self._encoders, list) else \
            [self._encoders] * len(columns)
        training = torch.is_grad_enabled()
        states: List[List[_RandomState]] = [[] for _ in columns]
        error = None
        chunks = [(i, k, b, e) for i, r in enumerate(spans) for k, (b, e) in enumerate(r)]
        if self.progress:
            from tqdm.auto import tqdm
            chunks = tqdm(chunks, desc="GradientCache: embed")
        parts: List[List[Tensor]] = [[] for _ in columns]
        widths = [_widths(c, r) for c, r in zip(columns, spans)]
        try:
            with torch.no_grad():
                for i, k, b, e in chunks:
                    chunk = _slice(columns[i], b, e, widths[i][k] if widths[i] else None)
                    if training:
                        states[i].append(_RandomState(_tensors(chunk)))
                    out = encoders[i](chunk)
                    if not isinstance(out, Tensor) or out.dim() != 2 or out.shape[0] != e - b:
                        raise ValueError(
                            f"GradientCache: encoder {i} returned {_describe(out)} for a chunk "
                            f"of {e - b} rows of column {i}; expected a 2-D tensor "
                            f"({e - b}, D)")
                    if parts[i] and out.shape[1:] != parts[i][0].shape[1:]:
                        raise ValueError(
                            f"GradientCache: encoder {i} returned embeddings of different "
                            f"widths {parts[i][0].shape[1]} and {out.shape[1]} across chunks")
                    parts[i].append(out)
        except Exception as exc:  # noqa: BLE001 - (OOM too) raised here and on every rank
            error = exc
        self._raise_everywhere(error, "failed embedding its chunks")
        whole = [torch.cat(col) if len(col) > 1 else col[0] for col in parts]
        if not training:
            with _loss_scope():
                return self.loss_fn(*whole)
        step = _Step(self, encoders, columns, spans, widths, states, _autocast_state(),
                     [[p.shape for p in col] for col in parts])
        del parts
        token = torch.empty(0, requires_grad=True)  # (puts the replay nodes in the graph)
        tracked = [_Replay.apply(token, emb, step, i) for i, emb in enumerate(whole)]
        with _loss_scope():
            loss = self.loss_fn(*tracked)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(f"GradientCache: loss_fn returned {_describe(loss)}; expected a "
                             "scalar tensor (a reduction 'mean' or 'sum')")
        unused = _unreached(loss, tracked)
        if unused:
            raise ValueError(f"GradientCache: the loss does not use column(s) {unused}: their "
                             "chunks would be embedded for nothing (and, under DDP, never "
                             "synchronised); remove them")
        return loss
