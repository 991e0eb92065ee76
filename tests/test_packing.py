"""Packed rows (engine/batch.py) train exactly like their documents alone, in both engines.

Three documents of awkward lengths are packed into one row (document starts, positions restarting, the last token
of each document predicting nothing, padding after them); the same documents alone are three rows of their own,
plain causal, padded at the end with unlabelled tokens (which, coming after the document, cannot change what the
document's tokens compute). The loss of one step and every gradient must agree to fp32 rounding: the packed row's
attention is masked to the document, its rotary angles are those of the document's own positions, and the loss
counts the same positions. Without the document mask or with positions 0..T-1 across the row, both differ by far
more than rounding (checked below, so the comparison is known to be able to fail).
"""

import pytest
import torch

from engine.batch import IGNORE_INDEX, Batch, loss_tokens
from engine.device import resolve_compute_dtype
from engine.model import ModelSpec
from engine.model.attention import document_mask
from engine.plan import build_plan
from engine.trainer import build_engine
from tests.util import SMALL, make_cfg

SEQ = 40
DOCS = [13, 1, 21]  # the last one leaves 5 positions of padding; a one-token document predicts nothing
PAD = 0


def _documents(vocab: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=g) for n in DOCS]


def _doc_labels(doc: torch.Tensor) -> torch.Tensor:
    """Next-token labels within the document; its last position predicts nothing."""
    return torch.cat([doc[1:], torch.tensor([IGNORE_INDEX])])


def packed_batch(docs) -> Batch:
    ids, labels, starts = [], [], []
    for doc in docs:
        starts.append(torch.full((len(doc),), sum(len(d) for d in ids), dtype=torch.int32))
        ids.append(doc)
        labels.append(_doc_labels(doc))
    used = sum(len(d) for d in ids)
    pad = SEQ - used
    ids.append(torch.full((pad,), PAD))
    labels.append(torch.full((pad,), IGNORE_INDEX))
    starts.append(torch.arange(used, SEQ, dtype=torch.int32))  # each padding token a document of its own
    return Batch(torch.cat(ids)[None], torch.cat(labels)[None], torch.cat(starts)[None])


def alone_batch(docs) -> Batch:
    """Each document alone in a row of its own, padded after it with unlabelled tokens."""
    pads = [SEQ - len(doc) for doc in docs]
    return Batch(torch.stack([torch.cat([doc, torch.full((pad,), PAD)]) for doc, pad in zip(docs, pads)]),
                 torch.stack([torch.cat([_doc_labels(doc), torch.full((pad,), IGNORE_INDEX)])
                              for doc, pad in zip(docs, pads)]))


def _step(engine: str, batch: Batch, overrides=()):
    """The loss of one step over one micro-batch and every unit's gradient (before clipping), from the engine's
    test hook."""
    cfg = make_cfg([f"engine={engine}", *SMALL, f"train.seq_len={SEQ}",
                    f"train.micro_batch_size={batch.ids_BT.shape[0]}", "train.grad_accum=1", *overrides])
    spec = ModelSpec(cfg.model)
    cpu = torch.device("cpu")
    plan = build_plan(spec, cfg, 0.0, 64.0, on_gpu=False)
    eng = build_engine(spec, cfg, cpu, resolve_compute_dtype(cfg.train.compute_dtype, cpu), plan)
    grads = {}

    def hook(unit, named):
        grads.update({f"{unit}.{name}": g.detach().clone() for name, g in named.items()})
    try:
        loss = eng.train_step([batch], 1e-3, grad_hook=hook)["loss"]
    finally:
        eng.close()
    return loss, grads


@pytest.mark.parametrize("engine, attention", [("reference", "sdpa"), ("stream", "sdpa"), ("stream", "triton")])
def test_a_packed_row_trains_like_its_documents_alone(engine, attention):
    """With SDPA the row's attention takes a dense document mask; the Triton kernel (run by the interpreter here)
    skips other documents' key blocks."""
    docs = _documents(256)
    packed, alone = packed_batch(docs), alone_batch(docs)
    assert loss_tokens([packed]) == loss_tokens([alone]) == sum(DOCS) - len(DOCS)
    backend = [f"train.attention={attention}", "model.head_dim=16"]  # 16: a head size the Triton kernel takes
    if attention == "triton":  # the interpreter runs every kernel program in Python: one layer, two heads
        backend += ["model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1"]
    loss_p, grads_p = _step(engine, packed, backend)
    loss_a, grads_a = _step(engine, alone, backend)
    assert loss_p == pytest.approx(loss_a, rel=1e-6)
    assert grads_p.keys() == grads_a.keys()
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)

    if attention == "triton":
        return  # tests/kernels/test_attention.py checks what the kernel computes without document starts
    # the comparison can fail: the same row without its document layout computes something else
    unmasked = Batch(packed.ids_BT, packed.labels_BT)
    loss_u, _ = _step(engine, unmasked, backend)
    assert abs(loss_u - loss_a) > 1e-3


def test_document_mask_is_causal_within_documents():
    starts = torch.tensor([[0, 0, 0, 3, 3, 5]], dtype=torch.int32)
    mask = document_mask(starts)[0, 0].int()
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],
                             [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]])
    assert torch.equal(mask, expected)


def test_a_step_that_counts_no_token_is_refused():
    blank = Batch(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), IGNORE_INDEX))
    with pytest.raises(ValueError, match="none of the 4 tokens"):
        loss_tokens([blank])
