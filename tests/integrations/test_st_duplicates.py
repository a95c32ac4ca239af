"""sentence-transformers adapters' ``mask_duplicates=True`` (issue 55): a positive whose text is
anchor i's own positive text is no negative of anchor i (the doc-to-query direction: an anchor
whose text is positive i's anchor text), hard negatives stay negatives.

The tiny float64 BERT of test_st_cached on the CPU: the loss and its parameter gradients equal
``cupynce.torch.info_nce`` with the text ids as ``labels`` (1e-12), and the loss equals the
float64 oracle on the model's embeddings; the cached classes equal the uncached ones (1e-9);
without duplicates the option changes no bit; refusals name the option.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")

import cupynce.torch as ct  # noqa: E402
from cupynce import reference as ref  # noqa: E402
from cupynce.integrations import sentence_transformers as c_st  # noqa: E402
from test_st_cached import WORDS, _model, _step, tiny_bert  # noqa: E402,F401

TOL = dict(rtol=1e-12, atol=1e-14)


def _texts():
    rng = np.random.default_rng(7)
    make = lambda: " ".join(rng.choice(WORDS, int(rng.integers(2, 8))))  # noqa: E731
    anchors = [make() for _ in range(9)]
    positives = [make() for _ in range(9)]
    positives[6] = positives[2]  # a duplicate positive: anchors 2 and 6 share it
    positives[8] = positives[2]
    anchors[5] = anchors[1]  # a duplicate anchor: positives 1 and 5 share their anchor
    negatives = [make() for _ in range(9)]
    negatives[0] = positives[2]  # a hard negative equal to a positive: stays a negative
    return anchors, positives, negatives


def _features(model, cols):
    return [dict(model.tokenize(c)) for c in cols]


def _ids(features):
    """Each row's id among the column's distinct token-id rows (the option's definition of a
    duplicate: identical token ids), by Python tuples: independent of ``torch.unique``."""
    rows = [tuple(r) for r in features["input_ids"].tolist()]
    return torch.tensor([sorted(set(rows)).index(r) for r in rows])


@pytest.mark.parametrize("cls,cols", [("MNRL", 2), ("MNRL", 3), ("MNSRL", 2)])
def test_equals_info_nce_with_the_text_ids(tiny_bert, cls, cols):
    anchors, positives, negatives = _texts()
    model = _model(tiny_bert, dropout=False)
    feats = _features(model, [anchors, positives, negatives][:cols])
    Loss = {"MNRL": c_st.MultipleNegativesRankingLoss,
            "MNSRL": c_st.MultipleNegativesSymmetricRankingLoss}[cls]
    got = _step(model, Loss(model, scale=7.0, mask_duplicates=True), feats)

    lp, la = _ids(feats[1]), _ids(feats[0])
    assert len(set(lp.tolist())) < len(lp) and len(set(la.tolist())) < len(la)

    class Manual(torch.nn.Module):
        def forward(self, features, labels):
            e = [model(dict(f))["sentence_embedding"] for f in features]
            negs = e[2] if len(e) > 2 else None
            loss = ct.info_nce(e[0], e[1], 1 / 7.0, negatives=negs, labels=lp, normalize=True)
            if cls == "MNSRL":
                loss = (loss + ct.info_nce(e[1], e[0], 1 / 7.0, labels=la, normalize=True)) / 2
            return loss

    want = _step(model, Manual(), feats)
    torch.testing.assert_close(got[0], want[0], **TOL)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():  # the oracle on the model's own embeddings
        e = [model(dict(f))["sentence_embedding"].numpy() for f in feats]
    loss = ref.info_nce(e[0], e[1], 1 / 7.0, negatives=e[2] if cols > 2 else None,
                        labels=lp.numpy(), normalize=True)[0]
    if cls == "MNSRL":
        loss = (loss + ref.info_nce(e[1], e[0], 1 / 7.0, labels=la.numpy(),
                                    normalize=True)[0]) / 2
    assert abs(float(got[0]) - loss) <= 1e-12 * abs(loss)
    plain = _step(model, Loss(model, scale=7.0), feats)
    assert abs(float(plain[0]) - float(got[0])) > 1e-3  # (the duplicates were masked)


@pytest.mark.parametrize("cls", ["MNRL", "MNSRL"])
def test_cached_equals_uncached(tiny_bert, cls):
    anchors, positives, _ = _texts()
    model = _model(tiny_bert, dropout=False)
    feats = _features(model, [anchors, positives])
    plain, cached = {"MNRL": (c_st.MultipleNegativesRankingLoss,
                              c_st.CachedMultipleNegativesRankingLoss),
                     "MNSRL": (c_st.MultipleNegativesSymmetricRankingLoss,
                               c_st.CachedMultipleNegativesSymmetricRankingLoss)}[cls]
    want = _step(model, plain(model, scale=7.0, mask_duplicates=True), feats)
    got = _step(model, cached(model, scale=7.0, mini_batch_size=4, mask_duplicates=True), feats)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-12)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_no_duplicates_no_change(tiny_bert):
    # (the tiny vocabulary tokenises these words alike: texts of distinct lengths differ)
    cols = [[" ".join(["w1"] * (k + 1)) for k in range(8)] for _ in range(2)]
    model = _model(tiny_bert, dropout=False)
    feats = _features(model, cols)
    a = _step(model, c_st.MultipleNegativesRankingLoss(model, mask_duplicates=True), feats)
    b = _step(model, c_st.MultipleNegativesRankingLoss(model), feats)
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


def test_refusals(tiny_bert):
    model = _model(tiny_bert, dropout=False)
    with pytest.raises(TypeError, match="mask_duplicates must be a bool"):
        c_st.CachedMultipleNegativesRankingLoss(model, mask_duplicates="yes")
    loss = c_st.MultipleNegativesRankingLoss(model, mask_duplicates=True)
    with pytest.raises(ValueError, match=r"sentence_features\[1\] has no input_ids tensor"):
        loss([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}, {"pixel_values": 1}], None)
    cached = c_st.CachedMultipleNegativesRankingLoss(model, mask_duplicates=True)
    with pytest.raises(NotImplementedError, match="calculate_loss: mask_duplicates=True"):
        cached.calculate_loss([[torch.zeros(2, 16)], [torch.zeros(2, 16)]])
    assert c_st.MultipleNegativesRankingLoss(model, mask_duplicates=True).get_config_dict()[
        "mask_duplicates"] is True


def _rank_features(rank):
    """Token ids of one rank's anchors and positives (n = 4, D-free): rank 1's positive 0 is
    rank 0's positive 2 (a duplicate across ranks), rank 0's positives 1 and 3 are one text;
    rank 1's rows are padded wider (its attention mask sets the padding apart)."""
    pos = {0: [[5, 6, 0, 0], [7, 8, 9, 0], [5, 9, 0, 0], [7, 8, 9, 0]],
           1: [[5, 9, 0, 0, 0, 0], [4, 4, 4, 4, 1, 0], [3, 0, 0, 0, 0, 0], [2, 2, 0, 0, 0, 0]]}
    anc = {0: [[1, 2, 0], [1, 3, 0], [2, 2, 2], [1, 2, 0]],
           1: [[1, 2, 0, 0], [6, 6, 6, 6], [2, 2, 2, 0], [9, 0, 0, 0]]}

    def feat(rows):
        ids = torch.tensor(rows)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}
    return [feat(anc[rank]), feat(pos[rank])]


def check_duplicates_across_ranks(rank, world):
    """mask_duplicates with gather_across_devices over gloo: the ids are the global batch's
    (the duplicate across ranks masked too); each rank's share of the loss and its rows'
    gradients as the one process on the concatenated batch gives them (float64)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(3)
    embs = [torch.randn(world * 4, 5, generator=g, dtype=torch.float64) for _ in range(2)]
    mine = slice(rank * 4, (rank + 1) * 4)
    for cls in (c_st.MultipleNegativesRankingLoss, c_st.MultipleNegativesSymmetricRankingLoss):
        loss_fn = cls(None, scale=7.0, gather_across_devices=True, mask_duplicates=True)
        ids = loss_fn._duplicates(_rank_features(rank))
        xs = [e[mine].clone().requires_grad_() for e in embs]
        loss = loss_fn.compute_loss_from_embeddings(xs, None, duplicates=ids)
        loss.backward()
        # one process: every rank's rows, the text ids by Python tuples over the global batch
        every = [_rank_features(r) for r in range(world)]
        glob = []
        for col in (1, 0):
            rows = [tuple(t for t, m in zip(r, mk) if m) for f in every
                    for r, mk in zip(f[col]["input_ids"].tolist(),
                                     f[col]["attention_mask"].tolist())]
            glob.append(torch.tensor([sorted(set(rows)).index(r) for r in rows]))
        assert torch.equal(ids[0], glob[0][mine]) or \
            len(set(zip(ids[0].tolist(), glob[0][mine].tolist()))) == len(set(ids[0].tolist()))
        ys = [e.clone().requires_grad_() for e in embs]
        one = cls(None, scale=7.0, mask_duplicates=True)
        want = one.compute_loss_from_embeddings(ys, None, duplicates=tuple(glob))
        want.backward()
        share = loss.detach().clone()
        dist.all_reduce(share)
        torch.testing.assert_close(share / world, want.detach(), **TOL)
        plain = one.compute_loss_from_embeddings([e.clone() for e in embs], None)
        assert abs(float(plain) - float(want)) > 1e-3  # (the masks change the loss)
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x.grad, world * y.grad[mine], **TOL)


@pytest.mark.parametrize("world", [2])
def test_duplicates_across_ranks_over_gloo(world):
    from test_torch_distributed import run_ranks

    run_ranks(world, ["check_duplicates_across_ranks"], module="test_st_duplicates")
