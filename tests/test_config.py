"""The strict run config tree: YAML + dotted overrides, unknown keys rejected, presets, order of batches.

Run: python -m pytest tests/test_config.py -q
"""

import dataclasses

import pytest

from draft_model.config import Range
from pipeline.config import ConfigError, RunConfig, apply_overrides, config_from_dict, load_config
from pipeline.order import batch_index_for, batch_sample_ids, batches_per_epoch


def test_presets_load_and_override():
    cfg = load_config("launch/configs/tiny.yaml", ["train.lr=3e-4", "draft.num_layers=2", "data.max_len=64"])
    assert cfg.train.lr == 3e-4 and cfg.draft.num_layers == 2 and cfg.data.max_len == 64
    # the v4 preset underneath, with the tiny file's shrinking applied on top
    assert (cfg.draft.ffn, cfg.draft.residual, cfg.draft.sliding_window, cfg.draft.block_size, cfg.draft.head) == \
        ("moe", "mhc", 128, 5, "markov")
    assert cfg.draft.moe.num_experts == 4
    for name in ("v4-flash", "v4-pro"):
        prod = load_config(f"launch/configs/{name}.yaml")
        assert prod.draft.num_layers == 3 and prod.draft.head_rank == 256 and prod.train.precision == "bf16"


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_config("launch/configs/tiny.yaml", ["train.learning_rate=1e-3"])
    assert "learning_rate" in str(e.value) and "'lr'" in str(e.value)
    with pytest.raises(ConfigError, match="unknown key"):
        config_from_dict({"trian": {}})
    with pytest.raises(ConfigError, match="num_expert"):
        config_from_dict({"draft": {"moe": {"num_expert": 3}}})


def test_types_and_values_are_checked_after_overrides():
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(None, ["train.max_steps=ten"])
    with pytest.raises(ValueError, match="zero_stage"):
        load_config(None, ["train.zero_stage=4"])
    with pytest.raises(ValueError, match="draft.head"):
        load_config(None, ["draft.head=lstm"])
    with pytest.raises(ValueError, match="unknown draft preset"):
        load_config(None, ["draft.preset=v5"])
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["train.lr"])


def _config_classes(cls: type, seen: list[type]) -> list[type]:
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and type(default) not in seen:
            seen.append(type(default))
            _config_classes(type(default), seen)
    return seen


def test_every_field_has_a_range_and_every_default_is_in_it():
    """Each section's RANGES table names every field that is not a boolean or a nested section (the type decides
    those), and holds nothing else: a new field cannot ship without its allowed values."""
    for cls in _config_classes(RunConfig, []):
        instance = cls()
        wanted = {f.name for f in dataclasses.fields(cls)
                  if not dataclasses.is_dataclass(getattr(instance, f.name))
                  and not isinstance(getattr(instance, f.name), bool)}
        assert set(cls.RANGES) == wanted, (cls.__name__, set(cls.RANGES) ^ wanted)
        assert all(isinstance(r, Range) for r in cls.RANGES.values())
    RunConfig().validate()


def test_round_trip_through_saved_dict():
    cfg = load_config("launch/configs/tiny.yaml")
    again = config_from_dict(cfg.to_dict())
    assert again == cfg


def test_batch_order_is_a_permutation_per_epoch_and_deterministic():
    n, b = 10, 3
    per = batches_per_epoch(n, b)
    assert per == 4
    epoch0 = [i for j in range(per) for i in batch_sample_ids(j, n, b, seed=7)]
    assert sorted(epoch0) == list(range(n))
    epoch1 = [i for j in range(per, 2 * per) for i in batch_sample_ids(j, n, b, seed=7)]
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0
    assert batch_sample_ids(5, n, b, seed=7) == batch_sample_ids(5, n, b, seed=7)
    # every (step, micro, rank) maps to a distinct batch, consecutively
    seen = [batch_index_for(s, m, r, 2, 3) for s in range(4) for m in range(2) for r in range(3)]
    assert seen == list(range(24))


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_bench_drafter_entries_build_valid_configs(scale, tmp_path):
    """bench/drafters.py's DRAFTERS give strict, valid run configs with the baselines' shapes (no bench run)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_drafters", Path(__file__).parents[1] / "bench" / "drafters.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    s = bench.SCALES[scale]
    cfgs = {name: bench.run_config(tmp_path / "data", s, name, tmp_path / name, 3).draft for name in bench.DRAFTERS}
    assert {"mtp1", "draft-lm"} <= set(cfgs)
    mtp, lm = cfgs["mtp1"], cfgs["draft-lm"]
    assert (mtp.arch, mtp.block_size, mtp.num_layers, mtp.target_layers, mtp.fuse_features) == ("eagle3", 1, 1,
                                                                                                  [-1], False)
    assert (lm.arch, lm.block_size, lm.num_layers, lm.target_layers) == ("draft-lm", bench.GAMMA,
                                                                          s["draft_layers"], [-1])
    for name, cfg in cfgs.items():  # same attention geometry for every drafter (DeepSeek-V4's: one K = V head)
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 1 if name == "v4-deepseek" else 3, 64), name
    v4, ds = cfgs["v4"], cfgs["v4-deepseek"]  # the production drafts: the same MoE, dspark's context layers
    assert (v4.arch, ds.arch, ds.mhc_streams, ds.moe.score_func) == ("dspark", "dsv4", 4, "sqrtsoftplus")
    assert [(c.moe.num_experts, c.moe.top_k, c.moe.expert_intermediate_size, c.moe.num_shared_experts)
            for c in (v4, ds)] == [(4, 2, 256, 1)] * 2
    assert v4.target_layers == ds.target_layers == cfgs["dspark"].target_layers
    # real text: the embedded corpus, one pass of fresh rows; the latency-matched depth comes in as an extra override
    real = bench.run_config(tmp_path / "data", s, "dspark-real", tmp_path / "r", 3).data
    assert (real.source, real.num_samples) == ("default", 3 * s["samples_per_batch"] * s["trainers"])
    lat = bench.run_config(tmp_path / "data", s, "dspark-lat", tmp_path / "l", 3, ["draft.num_layers=6"]).draft
    assert (lat.num_layers, lat.head_rank) == (6, cfgs["dspark"].head_rank) and cfgs["dspark-lat"] == cfgs["dspark"]
