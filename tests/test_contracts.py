"""Process messages: FeatureBatch validation, the one decode path (dtype, NaN rejection, final-as-context).

Run: python -m pytest tests/test_contracts.py -q
"""

import numpy as np
import pytest
import torch

from pipeline.contracts import FeatureBatch, TokenizedSample


def _fb(T=5, F=8, D=4, ctx_is_final=False, nan=False):
    fin = torch.randn(T, D).to(torch.bfloat16)
    if nan:
        fin[3, 1] = float("nan")
    ctx = torch.empty(T, 0, dtype=torch.bfloat16) if ctx_is_final else torch.randn(T, F).to(torch.bfloat16)
    return FeatureBatch(7, (11, 12), torch.arange(T), torch.ones(T, dtype=torch.bool), torch.tensor([0, 2, T]),
                        ctx, fin, ctx_is_final=ctx_is_final)


def test_decode_converts_once_and_restores_final_as_context():
    fb = _fb(ctx_is_final=True)
    out = fb.decode(torch.float32)
    assert out.ctx_feats_TF.dtype == torch.float32 and torch.equal(out.ctx_feats_TF, out.final_hidden_TD)
    assert torch.equal(out.final_hidden_TD, fb.final_hidden_TD.float())
    # on the wire, the final state travels once: 2 bytes x D per token, no context copy
    assert fb.nbytes() == _fb(ctx_is_final=False).nbytes() - 5 * 8 * 2


def test_decode_rejects_non_finite_features_by_name():
    with pytest.raises(ValueError, match=r"non-finite target final hidden states in batch 7 \(token rows \[3\]"):
        _fb(nan=True).decode(torch.float32)


def test_inconsistent_messages_are_rejected():
    with pytest.raises(ValueError, match="token count"):
        FeatureBatch(0, (1,), torch.arange(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]),
                     torch.zeros(3, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="seq_start"):
        FeatureBatch(0, (1, 2), torch.arange(4), torch.ones(4, dtype=torch.bool), torch.tensor([0, 4]),
                     torch.zeros(4, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="equal-length"):
        TokenizedSample(0, np.arange(4), np.ones(3, dtype=bool))


def test_feature_batch_pickles_its_tensors_out_of_band():
    """Under pickle protocol 5 (Ray's) every tensor travels as an out-of-band buffer, and the unpickled batch's
    tensors are views of those buffers (no copy out of the pickle), bf16 included, values exact."""
    import pickle

    fb = _fb()
    buffers = []
    data = pickle.dumps(fb, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 5 and len(data) < 1000
    assert sum(memoryview(b).nbytes for b in buffers) == fb.nbytes()
    out = pickle.loads(data, buffers=buffers)
    addresses = {np.frombuffer(b, dtype=np.uint8).ctypes.data for b in buffers}
    for name in ("input_ids_T", "loss_mask_T", "seq_start_S1", "ctx_feats_TF", "final_hidden_TD"):
        a, b = getattr(out, name), getattr(fb, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
        assert a.data_ptr() in addresses, name
    assert (out.batch_index, out.sample_ids, out.ctx_is_final) == (fb.batch_index, fb.sample_ids, fb.ctx_is_final)


def test_from_samples_concatenates_the_samples_in_order():
    samples = [TokenizedSample(4, np.array([5, 6, 7], np.int32), np.array([False, True, True])),
               TokenizedSample(9, np.array([8, 9], np.int32), np.array([True, False]))]
    fin = torch.randn(5, 4).to(torch.bfloat16)
    fb = FeatureBatch.from_samples(3, samples, torch.empty(5, 0, dtype=torch.bfloat16), fin, ctx_is_final=True)
    assert fb.batch_index == 3 and fb.sample_ids == (4, 9) and fb.ctx_is_final
    assert fb.input_ids_T.dtype == torch.int64 and fb.input_ids_T.tolist() == [5, 6, 7, 8, 9]
    assert fb.loss_mask_T.tolist() == [False, True, True, True, False]
    assert fb.seq_start_S1.dtype == torch.int64 and fb.seq_start_S1.tolist() == [0, 3, 5]
    assert fb.final_hidden_TD is fin
    with pytest.raises(ValueError, match="token count"):  # states for other tokens than the samples'
        FeatureBatch.from_samples(3, samples, torch.empty(4, 0), torch.randn(4, 4))
