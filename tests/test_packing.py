"""Tests of the anchor-bounded packer (pipeline/packing.py) and the BlockBatch indices it feeds.

Run: python -m pytest tests/test_packing.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.contracts import FeatureBatch
from pipeline.packing import PackStats, pack, padded_baseline_density, sample_anchors, valid_prefix

T_, F_ = True, False


def feature_batch(seqs: list[tuple[int, list[int], list[int]]], batch_index: int = 0, F: int = 2,
                  D: int = 3, feat_base: float = 0.0) -> FeatureBatch:
    """(sample_id, ids, mask) triples -> FeatureBatch; feature row t holds feat_base + t in every column."""
    ids = np.concatenate([np.asarray(s[1], dtype=np.int64) for s in seqs])
    mask = np.concatenate([np.asarray(s[2], dtype=bool) for s in seqs])
    lens = [len(s[1]) for s in seqs]
    T = ids.shape[0]
    row = feat_base + torch.arange(T, dtype=torch.float32)[:, None]
    return FeatureBatch(batch_index, tuple(s[0] for s in seqs), torch.from_numpy(ids), torch.from_numpy(mask),
                        torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64),
                        row.expand(T, F).clone(), row.expand(T, D).clone() + 0.5)


def random_seqs(n: int, rng: np.random.Generator, first_id: int = 0) -> list[tuple[int, list[int], list[int]]]:
    out = []
    for i in range(n):
        L = int(rng.integers(0, 40))
        out.append((first_id + i, rng.integers(0, 100, L).tolist(), (rng.random(L) < 0.7).tolist()))
    return out


# ---- valid_prefix ------------------------------------------------------------------------------------------

def test_valid_prefix_stops_at_sequence_end():
    mask = np.ones(6, dtype=bool)
    got = valid_prefix(mask, np.array([0, 2, 3, 4]), 3)
    assert got.tolist() == [[T_, T_, T_], [T_, T_, T_], [T_, T_, F_], [T_, F_, F_]]


def test_valid_prefix_stops_at_masked_out_token_and_stays_off():
    mask = np.array([0, 1, 1, 0, 1, 1, 1], dtype=bool)  # token 3 is not trained on, 4..6 are again
    got = valid_prefix(torch.from_numpy(mask), np.array([0, 1, 3]), 4)
    # anchor 0: targets 1,2 ok, 3 masked -> slot 3 (token 4) invalid too, although token 4 is trained on
    assert got.tolist() == [[T_, T_, F_, F_], [T_, F_, F_, F_], [T_, T_, T_, F_]]


def test_valid_prefix_short_sequences():
    assert valid_prefix(np.array([0, 1], dtype=bool), np.array([0]), 3).tolist() == [[T_, F_, F_]]
    assert valid_prefix(np.array([1, 0], dtype=bool), np.array([0]), 2).tolist() == [[F_, F_]]
    assert valid_prefix(np.array([1], dtype=bool), np.array([0]), 2).tolist() == [[F_, F_]]
    assert valid_prefix(np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64), 2).shape == (0, 2)
    with pytest.raises(ValueError, match="anchor positions"):
        valid_prefix(np.ones(3, dtype=bool), np.array([3]), 2)


# ---- sample_anchors ----------------------------------------------------------------------------------------

def test_sample_anchors_short_sequences_have_none_or_one():
    rng = np.random.default_rng(0)
    assert sample_anchors(np.zeros(0, dtype=bool), 4, 3, rng).tolist() == []
    assert sample_anchors(np.array([1], dtype=bool), 4, 3, rng).tolist() == []
    assert sample_anchors(np.array([1, 0], dtype=bool), 4, 3, rng).tolist() == []
    assert sample_anchors(np.array([0, 1], dtype=bool), 4, 3, rng).tolist() == [0]


@pytest.mark.parametrize("full_first", [True, False])
def test_anchors_only_where_next_token_is_trained(full_first):
    rng = np.random.default_rng(1)
    for _ in range(50):
        L = int(rng.integers(2, 80))
        mask = rng.random(L) < 0.5
        eligible = {p for p in range(L - 1) if mask[p + 1]}
        n = int(rng.integers(1, 20))
        p = sample_anchors(mask, n, 4, rng, full_blocks_first=full_first)
        assert len(p) == min(n, len(eligible)) and len(set(p.tolist())) == len(p)
        assert set(p.tolist()) <= eligible and p.tolist() == sorted(p.tolist())
        assert p.dtype == np.int64


def test_full_blocks_first_prefers_fully_valid_blocks_then_falls_back():
    K = 4
    mask = np.zeros(40, dtype=bool)
    mask[10:30] = True  # one trained span: anchors 9..28 eligible, 9..25 (17 of them) have a full block
    rng = np.random.default_rng(2)
    p = sample_anchors(mask, 10, K, rng)
    assert valid_prefix(mask, p, K).all() and set(p.tolist()) <= set(range(9, 26))
    p = sample_anchors(mask, 19, K, rng)  # more than the 17 full ones: all full + 2 partial
    full = valid_prefix(mask, p, K).all(axis=1)
    assert full.sum() == 17 and (~full).sum() == 2 and set(p[~full].tolist()) <= {26, 27, 28}
    # uniform choice over the same 20 eligible positions does pick partial blocks in 200 draws
    uniform = np.concatenate([sample_anchors(mask, 10, K, np.random.default_rng(s), full_blocks_first=False)
                              for s in range(20)])
    assert set(uniform.tolist()) == set(range(9, 29))


# ---- pack: a hand-built example with every number written out ---------------------------------------------

# A: 6 tokens, trained on tokens 2, 3, 5; B: 1 token (no block, dropped); C: 4 tokens, trained on 1..3
SEQ_A = (7, [10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 0, 1])
SEQ_B = (8, [20], [1])
SEQ_C = (9, [30, 31, 32, 33], [0, 1, 1, 1])


def check_hand_example(bb, stats: PackStats) -> None:
    assert bb.input_ids_T.tolist() == [10, 11, 12, 13, 14, 15, 30, 31, 32, 33]
    # features follow their tokens: B's row (input row 6) is gone
    assert bb.ctx_feats_TF[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert bb.final_hidden_TD[:, 2].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 7.5, 8.5, 9.5, 10.5]
    assert bb.seq_start_S1.tolist() == [0, 6, 10]
    assert bb.block_seq_N.tolist() == [0, 0, 0, 1, 1, 1]
    assert bb.anchor_pos_N.tolist() == [1, 2, 4, 0, 1, 2]  # every eligible anchor (anchors_per_seq = 8)
    assert bb.valid_NK.tolist() == [[T_, T_, F_], [T_, F_, F_], [T_, F_, F_],
                                    [T_, T_, T_], [T_, T_, F_], [T_, F_, F_]]
    assert bb.anchor_ids_N().tolist() == [11, 12, 14, 30, 31, 32]
    assert bb.target_index_NK().tolist() == [[1, 2, 3], [2, 3, 4], [4, 5, 5], [6, 7, 8], [7, 8, 9], [8, 9, 9]]
    assert bb.labels_NK().tolist() == [[12, 13, 14], [13, 14, 15], [15, 15, 15],
                                       [31, 32, 33], [32, 33, 33], [33, 33, 33]]
    assert bb.prev_tokens_NK().tolist() == [[11, 12, 13], [12, 13, 14], [14, 15, 15],
                                            [30, 31, 32], [31, 32, 33], [32, 33, 33]]
    assert bb.slot_positions_NK().tolist() == [[1, 2, 3], [2, 3, 4], [4, 5, 6], [0, 1, 2], [1, 2, 3], [2, 3, 4]]

    index, pos, valid = bb.context_window(0)  # full causal context: positions [0, p)
    assert valid.tolist() == [[T_, F_, F_, F_], [T_, T_, F_, F_], [T_, T_, T_, T_],
                              [F_, F_, F_, F_], [T_, F_, F_, F_], [T_, T_, F_, F_]]
    assert pos.tolist() == [[0, 1, 2, 3]] * 6
    assert index.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0], [6, 0, 0, 0], [6, 7, 0, 0]]

    index, pos, valid = bb.context_window(2)  # SWA: positions [max(0, p-2), p)
    assert pos.tolist() == [[0, 1], [0, 1], [2, 3], [0, 1], [0, 1], [0, 1]]
    assert valid.tolist() == [[T_, F_], [T_, T_], [T_, T_], [F_, F_], [T_, F_], [T_, T_]]
    assert index.tolist() == [[0, 0], [0, 1], [2, 3], [0, 0], [6, 0], [6, 7]]

    assert stats.sample_ids == (7, 9) and stats.sequences == 2 and stats.sequences_dropped == 1
    assert (stats.tokens, stats.blocks, stats.block_size) == (10, 6, 3)
    assert (stats.useful_block_tokens, stats.computed_block_tokens) == (10, 18)
    assert stats.density == pytest.approx(10 / 18)


def test_pack_hand_example_one_batch():
    check_hand_example(*pack([feature_batch([SEQ_A, SEQ_B, SEQ_C])], 3, 8, seed=0))


def test_pack_hand_example_split_over_batches():
    b1 = feature_batch([SEQ_A, SEQ_B], 0)
    b2 = feature_batch([SEQ_C], 1, feat_base=7.0)  # rows continue the numbering of the one-batch case
    check_hand_example(*pack([b1, b2], 3, 8, seed=123))


def test_density_is_one_when_every_block_is_fully_valid():
    rng = np.random.default_rng(3)
    seqs = [(i, rng.integers(0, 50, 50).tolist(), [1] * 50) for i in range(6)]
    bb, stats = pack([feature_batch(seqs)], block_size=4, anchors_per_seq=5, seed=0)
    assert stats.blocks == 30 and stats.density == 1.0 and bool(bb.valid_NK.all())


# ---- pack: determinism and capping ---------------------------------------------------------------------------

def anchors_by_sample(bb, stats: PackStats) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {sid: [] for sid in stats.sample_ids}
    for s, p in zip(bb.block_seq_N.tolist(), bb.anchor_pos_N.tolist()):
        out[stats.sample_ids[s]].append(p)
    return out


def test_anchors_depend_only_on_seed_and_sample_id():
    seqs = random_seqs(24, np.random.default_rng(4))
    seqs += [(100, list(range(60)), [1] * 60)]  # one sequence with far more eligible positions than anchors
    kw = dict(block_size=3, anchors_per_seq=5, seed=11)
    bb, stats = pack([feature_batch(seqs[:10]), feature_batch(seqs[10:])], **kw)
    ref = anchors_by_sample(bb, stats)
    assert stats.sequences + stats.sequences_dropped == len(seqs)
    # other composition and order: shuffled, split differently, mixed with unrelated samples
    perm = np.random.default_rng(5).permutation(len(seqs))
    other = [seqs[i] for i in perm] + random_seqs(7, np.random.default_rng(6), first_id=500)
    bb2, stats2 = pack([feature_batch(other[:3]), feature_batch(other[3:20]), feature_batch(other[20:])], **kw)
    got = anchors_by_sample(bb2, stats2)
    assert {sid: got[sid] for sid in ref} == ref
    assert len(ref[100]) == 5
    # a different seed changes the anchors of the long sequence (C(59, 5) possible choices)
    bb3, stats3 = pack([feature_batch(seqs)], block_size=3, anchors_per_seq=5, seed=12)
    assert anchors_by_sample(bb3, stats3)[100] != ref[100]


# ---- errors and the baseline ---------------------------------------------------------------------------------

def test_errors():
    fb = feature_batch([SEQ_A])
    with pytest.raises(ValueError, match="block_size"):
        pack([fb], 0, 4, seed=0)
    with pytest.raises(ValueError, match="anchors_per_seq"):
        pack([fb], 3, 0, seed=0)
    with pytest.raises(ValueError, match="at least one"):
        pack([], 3, 4, seed=0)
    hopeless = feature_batch([(0, [1], [1]), (1, [1, 2, 3], [1, 0, 0]), (2, [], [])])
    with pytest.raises(ValueError, match="no trainable block: every sequence is shorter than 2 tokens"):
        pack([hopeless], 3, 4, seed=0)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(np.ones(4, bool), 0, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="block_size"):
        valid_prefix(np.ones(4, bool), np.array([0]), 0)


def test_padded_baseline_density():
    assert padded_baseline_density([2, 4], [1, 3]) == pytest.approx(4 / 8)
    assert padded_baseline_density([2, 4]) == pytest.approx(6 / 8)
    # batches of 2: [2, 4] -> 8 computed, [10] -> 10 computed
    assert padded_baseline_density([2, 4, 10], [2, 4, 5], batch_size=2) == pytest.approx(11 / 18)
    with pytest.raises(ValueError, match="trainable"):
        padded_baseline_density([2, 4], [3, 1])


def test_trainers_pack_with_the_configured_anchor_rule():
    """data.full_blocks_first reaches the packer through the trainers' shared pack_micro_batch."""
    from pipeline.config import load_config
    from workers.trainer.step import pack_micro_batch

    fb = feature_batch([(i, list(range(40)), [True] * 40) for i in range(3)])
    for full_first in (True, False):
        cfg = load_config(None, [f"data.full_blocks_first={str(full_first).lower()}", "data.anchors_per_seq=8",
                                 "draft.block_size=5"])
        bb = pack_micro_batch(fb, 0, cfg, 3, torch.float32, torch.device("cpu")).batch
        ref, _ = pack([fb.decode(torch.float32)], 5, 8, cfg.data.seed, full_blocks_first=full_first)
        assert torch.equal(bb.anchor_pos_N, ref.anchor_pos_N)
    assert not torch.equal(*(pack([fb.decode(torch.float32)], 5, 8, 0, full_blocks_first=f)[0].anchor_pos_N
                             for f in (True, False)))
