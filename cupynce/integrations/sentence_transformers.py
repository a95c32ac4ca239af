"""sentence-transformers' in-batch-negatives losses on cupynce's kernels.

``MultipleNegativesRankingLoss`` and ``MultipleNegativesSymmetricRankingLoss`` with the
library's arguments, usable as the ``loss`` of a ``SentenceTransformerTrainer``:
``forward(sentence_features, labels)`` embeds the columns with the model as the library does
(its ``embed_columns``; sentence-transformers is imported there, at the first call) and
``compute_loss_from_embeddings(embeddings, labels)`` takes the embeddings directly: column 0
the anchors (n, D), column 1 their positives, further columns hard negatives.

``CachedMultipleNegativesRankingLoss`` and ``CachedMultipleNegativesSymmetricRankingLoss``:
the same losses with gradient caching (:class:`cupynce.torch.GradientCache`), for batches
whose encoder activations do not fit.

A SparseEncoder's: ``SpladePooling`` (fused with the masked LM's decoder),
``SparseMultipleNegativesRankingLoss``, and ``SpladeLoss`` / ``CachedSpladeLoss`` (the
library's, with cupynce's sparse MNRL as the base loss; the cached one on GradientCache).
"""
import bisect
import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _checks
from .. import torch as C
from ..torch import _registry
from ..torch.grad_cache import GradientCache
from ._common import dist_group, rank_share

__all__ = ["MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss",
           "CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss",
           "SparseMultipleNegativesRankingLoss", "SpladePooling", "SpladeLoss",
           "CachedSpladeLoss"]


def _normalize_for(op: str, fn: Optional[Callable]) -> bool:
    """sentence-transformers' ``cos_sim`` -> the op's ``normalize=True``, ``dot_score`` ->
    False (by name: the library need not be imported to build the loss)."""
    if fn is None:
        return True
    name = getattr(fn, "__name__", "")
    if name == "cos_sim":
        return True
    if name == "dot_score":
        return False
    raise NotImplementedError(f"{op}: similarity_fct={name or fn!r} has no cupynce equivalent; "
                              "cos_sim and dot_score do")


def _embed(model: nn.Module, features: Iterable[Dict[str, Any]]) -> List[Tensor]:
    try:
        from sentence_transformers.base.losses.merged_forward import embed_columns
    except ImportError:  # other versions: one forward per column, as their losses do
        return [model(f)["sentence_embedding"] for f in features]
    return embed_columns(model, features)


class MultipleNegativesRankingLoss(nn.Module):
    """InfoNCE of each anchor against every candidate of the batch: ``−mean_i log softmax_c
    (scale · sim(a_i, c))`` at c = p_i, the candidates being every positive and every hard
    negative of the batch — :func:`cupynce.torch.info_nce` with the positives as keys, the
    hard negatives as shared negatives and temperature 1 / scale.

    Parameters (the library's)
    --------------------------
    model : the SentenceTransformer (used by ``forward`` to embed the columns).
    scale : float > 0, default 20.
    similarity_fct : ``cos_sim`` (default; normalize=True) or ``dot_score``; anything else
        raises ``NotImplementedError``.
    gather_across_devices : bool
        With torch.distributed initialised and more than one process: every rank's anchors
        against every rank's candidates, by the op over the group.  Each rank returns its
        share as the library does (the mean over its anchors) and P dL/dx as its embeddings'
        gradient (the library's gather with gradient: the same).
    directions, partition_mode, hardness_mode, hardness_strength
        The default directions ("query_to_doc",) (any partition_mode: with one direction
        they agree), or ("query_to_doc", "doc_to_query") with ``partition_mode=
        "per_direction"`` (the symmetric loss: :class:`MultipleNegativesSymmetricRankingLoss`);
        the rest raise ``NotImplementedError``.  The hardness weighting (Lan et al. 2025) as
        the library's: the query-to-document logits of the penalised documents gain
        ``hardness_strength · stopgrad(sim)`` (:func:`cupynce.torch.info_nce`'s
        ``hardness_mode``; on CUDA its row blocks), also with ``gather_across_devices``.

    Keyword-only extras: ``workspace_bytes``, ``group`` (the default group unless given),
    ``precision`` (float32 products on CUDA, as :func:`cupynce.torch.info_nce`'s: None follows
    torch's TF32 setting, then ``cupynce.get_float32_precision()``), and ``mask_duplicates``
    (default False): a positive whose text is anchor i's own positive text (the same token
    ids, compared exactly on the device: ``torch.unique(input_ids, dim=0)``) is no negative
    of anchor i (and, in the doc-to-query direction, an anchor whose text is positive i's own
    anchor text is no negative of it) -- the duplicates the library's ``no_duplicates`` batch
    sampler avoids by skipping samples. Hard negatives stay negatives. Through
    :func:`cupynce.torch.info_nce`'s ``labels=`` (its row blocks on CUDA); with
    ``gather_across_devices`` the ids are the global batch's (every rank's token ids gathered,
    padding set apart by the attention mask: a duplicate on another rank is masked too).
    The loss is float32 for 16-bit embeddings (the op's accumulation dtype).
    """

    def __init__(self, model: Optional[nn.Module] = None, scale: float = 20.0,
                 similarity_fct: Optional[Callable] = None, gather_across_devices: bool = False,
                 directions: Sequence[str] = ("query_to_doc",), partition_mode: str = "joint",
                 hardness_mode: Optional[str] = None, hardness_strength: float = 0.0, *,
                 workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                 precision: Optional[str] = None, mask_duplicates: bool = False):
        super().__init__()
        op = type(self).__name__
        self.mask_duplicates = _checks.check_bool(op, "mask_duplicates", mask_duplicates)
        _checks.check_no_grad(op, "scale", scale)  # (kept as a float: a gradient would be lost)
        try:  # (a real, a NumPy scalar or a one-element tensor, as the library takes)
            value = float(scale)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(scale, bool) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{op}: scale must be a finite real > 0, got {scale!r}")
        self._check_options(op, tuple(directions), partition_mode, hardness_mode,
                            hardness_strength)
        self.model, self.scale = model, value
        self.similarity_fct = similarity_fct
        _normalize_for(op, similarity_fct)  # (checked now; read again at each call)
        self.gather_across_devices = gather_across_devices
        self.directions, self.partition_mode = tuple(directions), partition_mode
        self.hardness_mode, self.hardness_strength = hardness_mode, hardness_strength
        self.workspace_bytes, self.group = workspace_bytes, group
        self.precision = _registry.module_precision(op, precision)

    @staticmethod
    def _check_options(op, directions, partition_mode, hardness_mode, hardness_strength):
        if partition_mode not in ("joint", "per_direction"):
            raise ValueError(f"{op}: partition_mode must be 'joint' or 'per_direction', "
                             f"got {partition_mode!r}")
        symmetric = set(directions) == {"query_to_doc", "doc_to_query"} and \
            len(directions) == 2 and partition_mode == "per_direction"
        if directions != ("query_to_doc",) and not symmetric:
            raise NotImplementedError(
                f"{op}: directions={directions!r} with partition_mode={partition_mode!r} has "
                "no cupynce equivalent yet; ('query_to_doc',), or ('query_to_doc', "
                "'doc_to_query') with partition_mode='per_direction' (the symmetric loss)")
        if hardness_mode not in (None, "in_batch_negatives", "hard_negatives", "all_negatives"):
            raise ValueError(f"{op}: hardness_mode must be None, 'in_batch_negatives', "
                             f"'hard_negatives' or 'all_negatives', got {hardness_mode!r}")
        _checks.check_hardness(op, hardness_mode, hardness_strength)

    @property
    def normalize(self) -> bool:
        """cos_sim -> the op's normalize=True, dot_score -> False (from ``similarity_fct``)."""
        return _normalize_for(type(self).__name__, self.similarity_fct)

    def forward(self, sentence_features: Iterable[Dict[str, Any]], labels: Any) -> Tensor:
        if self.model is None:
            raise ValueError(f"{type(self).__name__}: forward() embeds with the model; this "
                             "loss has none (pass model=, or call compute_loss_from_embeddings)")
        features = list(sentence_features)
        duplicates = self._duplicates(features)  # (checked before the model runs)
        return self.compute_loss_from_embeddings(_embed(self.model, features), labels,
                                                 duplicates=duplicates)

    def _duplicates(self, features: Sequence[Dict[str, Any]]):
        """With ``mask_duplicates``: (the positives' text ids, the anchors' text ids) -- equal
        token-id rows share an id (``torch.unique(dim=0)``: exact, on the device); else
        None."""
        if not self.mask_duplicates:
            return None
        op = type(self).__name__
        ids = []
        for i in (1, 0):
            f = features[i] if i < len(features) else None
            if not isinstance(f, dict) or not isinstance(f.get("input_ids"), Tensor):
                raise ValueError(f"{op}: mask_duplicates=True compares the texts' token ids; "
                                 f"sentence_features[{i}] has no input_ids tensor")
            ids.append(self._text_ids(f["input_ids"], f.get("attention_mask")))
        return tuple(ids)

    def _text_ids(self, input_ids: Tensor, mask: Optional[Tensor]) -> Tensor:
        """(n,) ids of the rows' texts, equal for equal token ids (``torch.unique(dim=0)``:
        exact).  With ``gather_across_devices`` over several ranks: the ids among every
        rank's rows (the same computation on the same gathered rows on every rank), the
        padding (attention mask 0, and the columns past a rank's length) as -1."""
        group, size = dist_group(self.group) if self.gather_across_devices else (None, 1)
        if size == 1:
            return torch.unique(input_ids, dim=0, return_inverse=True)[1]
        x = input_ids.long()
        if isinstance(mask, Tensor) and mask.shape == x.shape:
            x = x.masked_fill(mask == 0, -1)
        shape = torch.tensor(list(x.shape), device=x.device)
        shapes = [torch.empty_like(shape) for _ in range(size)]
        dist.all_gather(shapes, shape, group=group)
        rows = {int(s[0]) for s in shapes}
        if len(rows) != 1:  # (every rank sees every shape: all raise, none waits)
            raise ValueError(f"{type(self).__name__}: mask_duplicates=True with "
                             f"gather_across_devices needs the same batch size on every rank, "
                             f"got {[int(s[0]) for s in shapes]}")
        width = max(int(s[1]) for s in shapes)
        x = torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)
        every = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(every, x.contiguous(), group=group)
        inv = torch.unique(torch.cat(every), dim=0, return_inverse=True)[1]
        rank = dist.get_rank(group)
        return inv[rank * x.shape[0]:(rank + 1) * x.shape[0]]

    def _columns(self, embeddings: Sequence[Tensor]):
        if len(embeddings) < 2:
            raise ValueError(f"Expected at least 2 embeddings, got {len(embeddings)}")
        negs = torch.cat(list(embeddings[2:]), 0) if len(embeddings) > 2 else None
        group, size = dist_group(self.group) if self.gather_across_devices else (None, 1)
        kw = dict(normalize=self.normalize, workspace_bytes=self.workspace_bytes,
                  precision=self.precision)
        return embeddings[0], embeddings[1], negs, group, size, kw

    def compute_loss_from_embeddings(self, embeddings: Sequence[Tensor], labels: Any = None,
                                     *, duplicates: Optional[Tuple[Tensor, Tensor]] = None
                                     ) -> Tensor:
        """The loss of the columns' embeddings (anchors, positives, hard negatives...);
        ``duplicates``: :meth:`_duplicates`' text ids (the positives', the anchors')."""
        q, p, negs, group, size, kw = self._columns(embeddings)
        red = dict(reduction="none", group=group) if size > 1 else {}
        t = 1.0 / self.scale
        # (the hardness weights the query-to-document direction alone, as the library's)
        hard = dict(hardness_mode=self.hardness_mode, hardness_strength=self.hardness_strength)
        weighted = _checks.check_hardness("", **hard)[0] != 0
        if duplicates is not None:  # (each direction's keys: the other column's text ids)
            loss = C.info_nce(q, p, t, negatives=negs, labels=duplicates[0], **hard, **red,
                              **kw)
            if len(self.directions) == 2:
                loss = (loss + C.info_nce(p, q, t, labels=duplicates[1], **red, **kw)) / 2
        elif len(self.directions) == 1:
            loss = C.info_nce(q, p, t, negatives=negs, **hard, **red, **kw)
        elif negs is None and not weighted:  # both directions, one softmax each: CLIP at a fixed scale
            loss = C.clip_loss(q, p, math.log(self.scale), **red, **kw)
        else:
            loss = (C.info_nce(q, p, t, negatives=negs, **hard, **red, **kw)
                    + C.info_nce(p, q, t, **red, **kw)) / 2
        return loss if size == 1 else rank_share(loss, size)

    def get_config_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale,
                "similarity_fct": "cos_sim" if self.normalize else "dot_score",
                "gather_across_devices": self.gather_across_devices,
                "directions": self.directions, "partition_mode": self.partition_mode,
                "hardness_mode": self.hardness_mode,
                "hardness_strength": self.hardness_strength, "backend": "cupynce",
                **({"mask_duplicates": True} if self.mask_duplicates else {}),
                **({} if self.precision is None else {"precision": self.precision})}

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    @property
    def citation(self) -> str:
        return ("@misc{henderson2017efficient, title={Efficient Natural Language Response "
                "Suggestion for Smart Reply}, author={Matthew Henderson and others}, year={2017}, "
                "eprint={1705.00652}, archivePrefix={arXiv}}")


class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss):
    """The symmetric form: ``(CE(anchor → every candidate) + CE(positive → every anchor)) / 2``
    — the library's directions ("query_to_doc", "doc_to_query") with one softmax per
    direction, which :class:`MultipleNegativesRankingLoss` also takes (the library deprecates
    this class for it).  Without hard negatives that is CLIP's loss at a fixed scale
    (:func:`cupynce.torch.clip_loss` with logit_scale = log(scale): one pass for both
    directions); with them, two :func:`cupynce.torch.info_nce` calls.  Arguments and
    distributed values as :class:`MultipleNegativesRankingLoss`."""

    def __init__(self, model: Optional[nn.Module] = None, scale: float = 20.0,
                 similarity_fct: Optional[Callable] = None, gather_across_devices: bool = False,
                 *, workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                 precision: Optional[str] = None, mask_duplicates: bool = False):
        super().__init__(model, scale, similarity_fct, gather_across_devices,
                         directions=("query_to_doc", "doc_to_query"),
                         partition_mode="per_direction", workspace_bytes=workspace_bytes,
                         group=group, precision=precision, mask_duplicates=mask_duplicates)


def _token_ranges(op: str, features: Dict[str, Any], budget: int) -> List[Tuple[int, int]]:
    """Row ranges of at most ``budget`` non-padding tokens each (a longer row alone), packed
    greedily in order from the attention mask: the library's ``mini_batch_num_tokens``."""
    mask = features.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"{op}: mini_batch_num_tokens needs the features' 2-D attention_mask "
                         "(per-row token counts); use mini_batch_size instead")
    ends = mask.sum(dim=1).cumsum(dim=0).tolist()  # (one host read per column and step)
    out, begin = [], 0
    while begin < len(ends):
        before = ends[begin - 1] if begin else 0
        end = max(bisect.bisect_right(ends, before + budget), begin + 1)
        out.append((begin, end))
        begin = end
    return out


def _check_mini_batches(op: str, mini_batch_size: Any, mini_batch_num_tokens: Any) -> None:
    """The cached losses' ``mini_batch_size`` (an int >= 1) and ``mini_batch_num_tokens``
    (None or an int >= 1), or ``ValueError`` naming the argument and its value."""
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or \
            mini_batch_size < 1:
        raise ValueError(f"{op}: mini_batch_size must be an int >= 1, got {mini_batch_size!r}")
    if mini_batch_num_tokens is not None and (
            isinstance(mini_batch_num_tokens, bool)
            or not isinstance(mini_batch_num_tokens, int) or mini_batch_num_tokens < 1):
        raise ValueError(f"{op}: mini_batch_num_tokens must be None or an int >= 1, got "
                         f"{mini_batch_num_tokens!r}")


def _cached_features(op: str, sentence_features: Iterable[Any]) -> List[Dict[str, Any]]:
    """The columns a cached loss embeds in mini-batches: the tokenizer's dicts of tensors (a
    ``BatchEncoding`` is a Mapping, as the trainer's dicts are), or an exception naming the
    column; flattened (unpadded) batches are not supported yet."""
    features = [dict(f) if isinstance(f, Mapping) else f for f in sentence_features]
    for i, f in enumerate(features):
        if not isinstance(f, dict):
            raise TypeError(f"{op}: sentence_features[{i}] is a {type(f).__name__}; "
                            "expected the tokenizer's dict of tensors")
        if "cu_seq_lens_q" in f:
            raise NotImplementedError(f"{op}: flattened (unpadded) batches are not "
                                      "supported yet")
    return features


def _ddp_of(model: nn.Module) -> List[nn.Module]:
    """The DistributedDataParallel wrapper an encoder's calls run through (a torch.compile'd
    one too), for :class:`GradientCache`'s single all-reduce."""
    inner = getattr(model, "_orig_mod", model)
    return [inner] if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else []


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """:class:`MultipleNegativesRankingLoss` with gradient caching: the library's
    ``CachedMultipleNegativesRankingLoss`` (its constructor and call), on
    :class:`cupynce.torch.GradientCache`.

    ``forward(sentence_features, labels)`` embeds every column in mini-batches without a graph
    (the CPU / CUDA random states of each saved), runs the fused loss once over the whole
    batch, and returns the loss; its ``backward()`` re-embeds each mini-batch with a graph —
    under the saved random states (dropout replays its masks) and the autocast state of the
    forward, also when a plain loop calls ``backward()`` outside ``torch.autocast`` — and
    backpropagates the mini-batch's rows of the embeddings' gradient. Under DDP the gradients
    are all-reduced once, at the last mini-batch.

    Parameters: the library's — ``model``, ``scale``, ``similarity_fct`` (cos_sim / dot_score),
    ``mini_batch_size`` (rows per mini-batch, default 32), ``mini_batch_num_tokens`` (instead:
    mini-batches of at most this many non-padding tokens, packed in order; a longer row
    alone), ``gather_across_devices``, ``directions`` / ``partition_mode`` (as
    :class:`MultipleNegativesRankingLoss`), ``show_progress_bar``, ``hardness_mode`` /
    ``hardness_strength`` (as :class:`MultipleNegativesRankingLoss`'s) — plus the
    keyword-only ``workspace_bytes``, ``group``, ``precision``. A mini-batch of padded text
    drops the positions that are padding in all its rows, as the library's does. Not supported
    yet: ``MatryoshkaLoss`` around it, ``DistributedDataParallel(static_graph=True)`` and
    frozen routes of a DDP model (each raises, naming itself).
    """

    uses_gradient_cache = True  # (the library's flag: the backward re-embeds)

    def __init__(self, model: Optional[nn.Module] = None, scale: float = 20.0,
                 similarity_fct: Optional[Callable] = None, mini_batch_size: int = 32,
                 mini_batch_num_tokens: Optional[int] = None,
                 gather_across_devices: bool = False,
                 directions: Sequence[str] = ("query_to_doc",), partition_mode: str = "joint",
                 show_progress_bar: bool = False, hardness_mode: Optional[str] = None,
                 hardness_strength: float = 0.0, *, workspace_bytes: Optional[int] = None,
                 group: Optional[Any] = None, precision: Optional[str] = None,
                 mask_duplicates: bool = False):
        super().__init__(model, scale, similarity_fct, gather_across_devices, directions,
                         partition_mode, hardness_mode, hardness_strength,
                         workspace_bytes=workspace_bytes, group=group, precision=precision,
                         mask_duplicates=mask_duplicates)
        _check_mini_batches(type(self).__name__, mini_batch_size, mini_batch_num_tokens)
        self.mini_batch_size, self.mini_batch_num_tokens = mini_batch_size, mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def forward(self, sentence_features: Iterable[Dict[str, Any]], labels: Any = None) -> Tensor:
        op = type(self).__name__
        if self.model is None:
            raise ValueError(f"{op}: forward() embeds with the model; this loss has none "
                             "(pass model=, or call compute_loss_from_embeddings)")
        if "calculate_loss" in vars(self):  # (MatryoshkaLoss wraps the library's protocol)
            raise NotImplementedError(
                f"{op} inside MatryoshkaLoss is not supported yet (it re-weights the cached "
                "embeddings through the library's calculate_loss); use the library's cached "
                "class there, or cupynce's uncached MultipleNegativesRankingLoss")
        features = _cached_features(op, sentence_features)
        model = self.model
        group = dist_group(self.group)[0] if self.gather_across_devices else None
        ddp = _ddp_of(model)
        duplicates = self._duplicates(features)
        cache = GradientCache(lambda f: model(f)["sentence_embedding"],
                              lambda *embs: self.compute_loss_from_embeddings(
                                  embs, labels, duplicates=duplicates),
                              self.mini_batch_size, group=group, ddp=ddp,
                              progress=self.show_progress_bar)
        ranges = None if self.mini_batch_num_tokens is None else \
            [_token_ranges(op, f, self.mini_batch_num_tokens) for f in features]
        return cache(*features, ranges=ranges)

    def calculate_loss(self, reps: Sequence[Sequence[Tensor]], labels: Any = None, *,
                       with_backward: bool = False) -> Tensor:
        """The library's cached-loss protocol: the loss over the per-mini-batch embeddings
        ``reps`` (one list per column); ``with_backward``: their gradients into ``.grad``,
        the loss returned detached. (``forward`` does not go through it.)"""
        if self.mask_duplicates:
            raise NotImplementedError(f"{type(self).__name__}.calculate_loss: mask_duplicates="
                                      "True needs the texts, which the cached embeddings lack")
        loss = self.compute_loss_from_embeddings([torch.cat(list(r)) for r in reps], labels)
        if with_backward:
            loss.backward()
            return loss.detach()
        return loss

    def get_config_dict(self) -> Dict[str, Any]:
        return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size,
                "mini_batch_num_tokens": self.mini_batch_num_tokens}


class CachedMultipleNegativesSymmetricRankingLoss(CachedMultipleNegativesRankingLoss):
    """The symmetric form with gradient caching: the library's
    ``CachedMultipleNegativesSymmetricRankingLoss`` (its arguments), which is
    :class:`CachedMultipleNegativesRankingLoss` with the directions ("query_to_doc",
    "doc_to_query") and one softmax per direction (:class:`MultipleNegativesSymmetricRankingLoss`:
    CLIP's loss at a fixed scale without hard negatives)."""

    def __init__(self, model: Optional[nn.Module] = None, scale: float = 20.0,
                 similarity_fct: Optional[Callable] = None, mini_batch_size: int = 32,
                 mini_batch_num_tokens: Optional[int] = None,
                 gather_across_devices: bool = False, show_progress_bar: bool = False, *,
                 workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                 precision: Optional[str] = None, mask_duplicates: bool = False):
        super().__init__(model, scale, similarity_fct, mini_batch_size, mini_batch_num_tokens,
                         gather_across_devices, ("query_to_doc", "doc_to_query"),
                         "per_direction", show_progress_bar, workspace_bytes=workspace_bytes,
                         group=group, precision=precision, mask_duplicates=mask_duplicates)


class SparseMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """sentence-transformers' ``SparseMultipleNegativesRankingLoss``: a SparseEncoder's
    ranking loss, :class:`MultipleNegativesRankingLoss` on the (B, V) sparse embeddings with
    the library's sparse defaults -- ``similarity_fct=dot_score`` (None means it here), scale
    1 -- and the same arguments otherwise.  The base loss of :class:`SpladeLoss` and
    :class:`CachedSpladeLoss` (which turn the library's class given as ``loss`` into this
    one), or of the library's own ``SpladeLoss``."""

    def __init__(self, model: Optional[nn.Module] = None, scale: float = 1.0,
                 similarity_fct: Optional[Callable] = None, gather_across_devices: bool = False,
                 directions: Sequence[str] = ("query_to_doc",), partition_mode: str = "joint",
                 hardness_mode: Optional[str] = None, hardness_strength: float = 0.0, *,
                 workspace_bytes: Optional[int] = None, group: Optional[Any] = None,
                 precision: Optional[str] = None, mask_duplicates: bool = False):
        if similarity_fct is None:
            from sentence_transformers.util import dot_score as similarity_fct
        super().__init__(model, scale, similarity_fct, gather_across_devices, directions,
                         partition_mode, hardness_mode, hardness_strength,
                         workspace_bytes=workspace_bytes, group=group, precision=precision,
                         mask_duplicates=mask_duplicates)


def _as_cupynce(loss: nn.Module) -> nn.Module:
    """``SpladeLoss``'s base loss: the library's ``SparseMultipleNegativesRankingLoss`` as
    cupynce's, with its settings; any other loss (cupynce's, the library's margin or
    distillation losses, ...) as given."""
    from sentence_transformers.sparse_encoder.losses import \
        SparseMultipleNegativesRankingLoss as Lib
    if type(loss) is not Lib:
        return loss
    return SparseMultipleNegativesRankingLoss(
        loss.model, loss.scale, loss.similarity_fct, loss.gather_across_devices,
        loss.directions, loss.partition_mode, loss.hardness_mode, loss.hardness_strength)


_SPLADE_LOSS_DOC = """sentence-transformers' ``SpladeLoss`` (its arguments) with the base
    loss on cupynce's kernels: a library ``SparseMultipleNegativesRankingLoss`` given as
    ``loss`` becomes :class:`SparseMultipleNegativesRankingLoss` with the same settings;
    another base loss runs as given.  The FLOPS regularisers are the library's.  A subclass
    of the library's class (built at first use: sentence-transformers is imported then), so
    the trainer and the model card treat it as the library's."""

_CACHED_SPLADE_DOC = """sentence-transformers' ``CachedSpladeLoss`` (its arguments: those
    of :class:`SpladeLoss` plus ``mini_batch_size``, ``mini_batch_num_tokens``,
    ``show_progress_bar``) on :class:`cupynce.torch.GradientCache`: every column embedded in
    mini-batches without a graph, the whole loss -- the base loss (cupynce's sparse MNRL, as
    :class:`SpladeLoss` chooses it) plus the weighted FLOPS regularisers -- once over the
    whole batch, and at ``backward()`` each mini-batch embedded again with a graph under its
    saved random states, backpropagating its rows of the embeddings' gradient.  With cupynce's
    fused ``SpladePooling`` in the SparseEncoder no mini-batch forms its (b, L, V) logits
    either.  ``forward`` returns the library's dict of components (the trainer sums it; the
    first carries the gradient, the others are detached values for the logs).  Under DDP the
    gradients are all-reduced once, at the last mini-batch; with the base loss's
    ``gather_across_devices`` the ranks' inputs are compared first."""


def _splade_loss_classes():
    """cupynce's SpladeLoss and CachedSpladeLoss, subclasses of the library's SpladeLoss
    (imported here, on first use)."""
    from sentence_transformers.sparse_encoder.losses import SpladeLoss as LibSpladeLoss

    class SpladeLoss(LibSpladeLoss):
        __doc__ = _SPLADE_LOSS_DOC

        def __init__(self, model, loss, *args, **kwargs):
            super().__init__(model, _as_cupynce(loss), *args, **kwargs)

        def components(self, embeddings: List[Tensor], labels: Any = None
                       ) -> Dict[str, Tensor]:
            """The loss's parts from the columns' embeddings (column 0 the queries): the
            base loss (its own dict, or ``base_loss``), the weighted document and query
            regularisers."""
            parts: Dict[str, Tensor] = {}
            base = self.loss.compute_loss_from_embeddings(embeddings, labels)
            parts.update(base if isinstance(base, dict) else {"base_loss": base})
            docs = embeddings if self.use_document_regularizer_only else embeddings[1:]
            parts["document_regularizer_loss"] = self.document_regularizer_weight * \
                self.document_regularizer.compute_loss_from_embeddings(torch.cat(docs))
            if self.query_regularizer_weight is not None:
                parts["query_regularizer_loss"] = self.query_regularizer_weight * \
                    self.query_regularizer.compute_loss_from_embeddings(embeddings[0])
            return parts

    class CachedSpladeLoss(SpladeLoss):
        __doc__ = _CACHED_SPLADE_DOC
        uses_gradient_cache = True  # (the library's flag: the backward re-embeds)

        def __init__(self, model, loss, document_regularizer_weight: float,
                     query_regularizer_weight: Optional[float] = None,
                     document_regularizer: Optional[nn.Module] = None,
                     query_regularizer: Optional[nn.Module] = None,
                     document_regularizer_threshold: Optional[int] = None,
                     query_regularizer_threshold: Optional[int] = None,
                     use_document_regularizer_only: bool = False, mini_batch_size: int = 32,
                     mini_batch_num_tokens: Optional[int] = None,
                     show_progress_bar: bool = False):
            super().__init__(model, loss, document_regularizer_weight, query_regularizer_weight,
                             document_regularizer, query_regularizer,
                             document_regularizer_threshold, query_regularizer_threshold,
                             use_document_regularizer_only)
            _check_mini_batches("CachedSpladeLoss", mini_batch_size, mini_batch_num_tokens)
            self.mini_batch_size = mini_batch_size
            self.mini_batch_num_tokens = mini_batch_num_tokens
            self.show_progress_bar = show_progress_bar

        def forward(self, sentence_features: Iterable[Dict[str, Any]],
                    labels: Any = None) -> Dict[str, Tensor]:
            op = "CachedSpladeLoss"
            features = _cached_features(op, sentence_features)
            model, values = self.model, {}

            def total(*embeddings: Tensor) -> Tensor:
                parts = self.components(list(embeddings), labels)
                values.update((k, v.detach()) for k, v in parts.items())
                return sum(parts.values())
            base = self.loss
            group = dist_group(getattr(base, "group", None))[0] \
                if getattr(base, "gather_across_devices", False) else None
            cache = GradientCache(lambda f: model(f)["sentence_embedding"], total,
                                  self.mini_batch_size, group=group, ddp=_ddp_of(model),
                                  progress=self.show_progress_bar)
            ranges = None if self.mini_batch_num_tokens is None else \
                [_token_ranges(op, f, self.mini_batch_num_tokens) for f in features]
            loss = cache(*features, ranges=ranges)
            # (the trainer sums the dict: the first part carries the loss and its gradient,
            # the others are the detached values; their sum is the loss)
            first = next(iter(values))
            out = dict(values)
            out[first] = loss - sum(v for k, v in values.items() if k != first)
            return out

        def get_config_dict(self) -> Dict[str, Any]:
            return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size,
                    "mini_batch_num_tokens": self.mini_batch_num_tokens}

    for cls in (SpladeLoss, CachedSpladeLoss):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return SpladeLoss, CachedSpladeLoss


class _DecoderInput(nn.Module):
    """Stands in for a masked-LM's decoder: returns its input, the transformed hidden states
    (B, L, D), and keeps the decoder's ``weight`` / ``bias`` Parameters (so that the model's
    weight tying and its ``cls.predictions.bias`` still find them)."""

    def __init__(self, decoder: nn.Linear):
        super().__init__()
        self.weight, self.bias = decoder.weight, decoder.bias
        self.in_features, self.out_features = decoder.in_features, decoder.out_features

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden


_SPLADE_DOC = """sentence-transformers' ``SpladePooling`` for a ``SparseEncoder``, fused with the
    masked LM's decoder: the (B, L, V) logits are never formed.

    ``SparseEncoder(modules=[mlm, SpladePooling(mlm)])`` where the library has
    ``SparseEncoder(modules=[mlm, SpladePooling()])``: ``mlm`` is the fill-mask
    ``Transformer`` (or ``MLMTransformer``) module.  On construction its model's output
    embeddings (the decoder ``nn.Linear(D, V)``, e.g. BERT's ``cls.predictions.decoder``) are
    replaced by a pass-through, so the transformer module's ``token_embeddings`` become the
    decoder's input (B, L, D), and this module computes the library's pooled output with
    :func:`cupynce.torch.splade_pool` on the decoder's own (tied) weight and bias.  A subclass
    of the library's class (built at first use: sentence-transformers is imported then), so
    the SparseEncoder finds it as its SPLADE pooling; it owns no parameters (they are the
    masked LM's).

    Saving (``save_pretrained``, trainer checkpoints) writes the library's files — the masked
    LM with its decoder's weights under their usual names, this module's config — but names
    this class in ``modules.json``, so the library loads such a folder only with
    ``trust_remote_code=True``; it then gets its own, unfused ``SpladePooling`` (this class's
    ``load``) and the full decoder.  Fuse again with ``SpladePooling(mlm)``.  :meth:`restore`
    puts the decoder back and returns an unfused library ``SpladePooling`` to use in this
    module's place (``model[1] = pool.restore()``): saved then, the folder is the library's
    alone.

    Parameters (the library's, plus the transformer module first)
    --------------------------------------------------------------
    pooling_strategy : "max" (default); "sum" raises ``NotImplementedError``.
    activation_function : "relu" (default) | "log1p_relu" — the library's names: its "relu"
        is log(1 + ReLU(logits)) (SPLADE's activation, cupynce's "log1p_relu") and its
        "log1p_relu" applies log1p once more (on the (B, V) output here: log1p is monotone,
        so it commutes with the max).
    embedding_dimension, chunk_size : as the library's (no chunks are needed here: nothing of
        size B × L × V is formed).
    precision : keyword-only, float32 logit products on CUDA, as
        :func:`cupynce.torch.splade_pool`'s (None: torch's TF32 setting, then
        ``cupynce.get_float32_precision()``); not saved (a saved folder loads the library's
        class).

    Masked-LM heads whose decoder has no bias while the head adds its own after it (ESM, LUKE:
    ``decoder(x) + bias``) raise ``NotImplementedError``: the fused op would drop that bias.
    The library's flattened input (``cu_seq_lens_q``, from unpadded flash-attention batches)
    raises ``NotImplementedError``.
    """


def _splade_pooling_class():
    """cupynce's SpladePooling, a subclass of the library's (imported here, on first use)."""
    from sentence_transformers.sparse_encoder.modules import SpladePooling as LibPooling

    class SpladePooling(LibPooling):
        __doc__ = _SPLADE_DOC

        def __init__(self, transformer: nn.Module, pooling_strategy: str = "max",
                     activation_function: str = "relu",
                     embedding_dimension: Optional[int] = None,
                     chunk_size: Optional[int] = None, *, precision: Optional[str] = None):
            if pooling_strategy != "max":
                raise NotImplementedError(f"SpladePooling: pooling_strategy={pooling_strategy!r}"
                                          " has no cupynce equivalent; only 'max'")
            super().__init__(pooling_strategy, activation_function, embedding_dimension,
                             chunk_size)
            model = getattr(transformer, "auto_model", transformer)
            decoder = model.get_output_embeddings() \
                if hasattr(model, "get_output_embeddings") else None
            if isinstance(decoder, _DecoderInput):
                raise ValueError("SpladePooling: this transformer's decoder is already fused "
                                 "into another cupynce SpladePooling")
            if not isinstance(decoder, nn.Linear):
                raise TypeError("SpladePooling: the transformer module's model must have an "
                                "nn.Linear decoder as its output embeddings (a masked LM), got "
                                f"{type(decoder).__name__}")
            if decoder.bias is None:
                for parent in model.modules():
                    if any(c is decoder for c in parent.children()) and \
                            isinstance(getattr(parent, "bias", None), nn.Parameter):
                        raise NotImplementedError(
                            f"SpladePooling: {type(parent).__name__} adds its own bias after a "
                            "bias-free decoder (decoder(x) + bias); the fused op would drop it")
            # (in lists: the Parameters are the masked LM's; no duplicate state_dict keys)
            self._head = [C.SpladePooling.from_decoder(decoder, activation="log1p_relu",
                                                       precision=precision)]
            if self.embedding_dimension is None:
                self.embedding_dimension = decoder.out_features
            self._model, self._decoder = [model], [decoder]
            model.set_output_embeddings(_DecoderInput(decoder))

        @classmethod
        def load(cls, *args: Any, **kwargs: Any):
            """A saved folder loads as the library's own (unfused) SpladePooling."""
            return LibPooling.load(*args, **kwargs)

        def restore(self):
            """Put the masked LM's decoder back (its logits again) and return an unfused
            library ``SpladePooling`` of the same settings, to use in this module's place."""
            self._model[0].set_output_embeddings(self._decoder[0])
            return LibPooling(self.pooling_strategy, self.activation_function,
                              self.embedding_dimension, self.chunk_size)

        def forward(self, features: Dict[str, Tensor]) -> Dict[str, Tensor]:
            if "cu_seq_lens_q" in features:
                raise NotImplementedError("SpladePooling: flattened (unpadded) batches are not "
                                          "supported yet")
            if not isinstance(self._model[0].get_output_embeddings(), _DecoderInput):
                raise RuntimeError("SpladePooling: the decoder was restored; use the library "
                                   "SpladePooling that restore() returned")
            out = self._head[0](features["token_embeddings"], features.get("attention_mask"))
            if self.activation_function == "log1p_relu":
                out = torch.log1p(out)
            features["sentence_embedding"] = out
            return features

    SpladePooling.__module__ = __name__
    SpladePooling.__qualname__ = "SpladePooling"
    return SpladePooling


def __getattr__(name: str) -> Any:  # the library's subclasses: built (and sentence-transformers
    if name == "SpladePooling":    # imported) at first use
        cls = _splade_pooling_class()
        globals()["SpladePooling"] = cls
        return cls
    if name in ("SpladeLoss", "CachedSpladeLoss"):
        globals()["SpladeLoss"], globals()["CachedSpladeLoss"] = _splade_loss_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
