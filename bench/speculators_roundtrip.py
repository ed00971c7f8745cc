"""Round trip through speculators (vLLM's own draft-format library): our teacher-forced block logits and confidence
logits against those speculators computes from the engine export of the same draft (issue #24 item 4).

Run (the project's python):  python bench/speculators_roundtrip.py [--venv /root/specvenv] [--keep DIR]

speculators never enters the project's environment (it pins transformers <= 5.19 and pulls CUDA torchvision); it
lives in its own venv, made once:
    python3.11 -m venv /root/specvenv
    /root/specvenv/bin/pip install speculators==0.9.0 torch==2.13.0
    /root/specvenv/bin/pip uninstall -y torchvision torchaudio   # PyPI's builds break `import transformers` on CPU
Without that venv the script exits 2 with that recipe.

For each variant (dspark-markov, dflash, dspark-rnn, and dspark-markov with a 6-token sliding window and RoPE theta
5e5), shrunk to D 64, V 160 on a random target, with every weight perturbed (W2, the biases and every norm weight
included, so nothing is trivially zero or one): our export (pipeline.export.export_draft) ->
serving.engine_export.write_engine_export(.., "speculators", ..) -> a child process in the venv that loads it with
speculators' own `SpeculatorModel.from_pretrained` and runs speculators' own teacher-forced DSpark forward on the same
packed batch (2 sequences of 30 and 26 tokens, 5 blocks, one anchor at p=0): same token ids, context hidden states
and per-document positions. Its anchors are made ours by marking exactly our anchors in the loss mask (speculators
draws its anchors at random among the marked positions, then sorts them; the child checks it used ours). Its block
logits (base + Markov bias) and confidence logits are captured by replacing `compute_metrics`, which receives both;
it runs eager attention (`_attn_implementation="eager"`: its default, flex attention with a compiled block mask, is
the GPU path). Ours: `DraftModel.forward` -> hidden_NKD @ LM_head^T + head factor @ W2, and conf_logit_NK.

The verifier's frozen embedding, LM head and final norm reach speculators the way they do in real use: the child
writes the random target as a 3-layer Qwen3ForCausalLM with transformers' own `save_pretrained`, the export names
that directory as its verifier, and `from_pretrained` -> `load_verifier_weights` reloads `embed_tokens`, `lm_head`
and `verifier_norm` from it (setting the tensors by hand after loading would skip the loader real checkpoints take).

Negative controls, which must miss the tolerance: the same exports with q/k-norm weights replaced by ones (what an
export of a draft trained without q/k norm amounts to), `sample_from_anchor: false`, on the windowed variant
`sliding_window_non_causal: false`, the window dropped (full-attention layer types) and the default RoPE theta, and
the RNN head's joint projection in the wrong (cand, gate, out) order.
Pass = max |delta logit| and max |delta confidence logit| both <= 1e-4 (fp32 throughout). Exit 0 when every variant
passes and every control is caught. Last line:
    speculators_roundtrip variants=N max_abs_dlogit=X max_abs_dconf=Y pass=K/N control_caught=C/M
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from draft_model.batch import BlockBatch
from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from pipeline.export import export_draft
from serving.engine_export import write_engine_export

TOL = 1e-4
V, D, NUM_TARGET_LAYERS, MASK_ID = 160, 64, 3, 3
CONTEXT_LAYERS = [1, 2]  # HF hidden-state indices = speculators' aux_hidden_state_layer_ids (not 3: the final
# state after the norm, which engines never hand a draft and our exports refuse, serving/layer_ids.py)
SEQ_LENS = [30, 26]
BLOCKS = [(0, 0), (0, 9), (0, 23), (1, 4), (1, 18)]  # (sequence, anchor position): every block inside its sequence
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, head_rank=16, rnn_state_size=16,
             target_layers=CONTEXT_LAYERS, mask_token_id=MASK_ID)
VARIANTS = {"dspark-markov": ("dspark-markov", {}), "dflash": ("dflash", {}), "dspark-rnn": ("dspark-rnn", {}),
            # a window that cuts the context of 3 of the 5 blocks, and a RoPE theta other than the default
            "markov-swa6-theta5e5": ("dspark-markov", {"sliding_window": 6, "rope_theta": 5e5})}
VENV_RECIPE = ("python3.11 -m venv {v} && {v}/bin/pip install speculators==0.9.0 torch==2.13.0 && "
               "{v}/bin/pip uninstall -y torchvision torchaudio")

# Runs under the venv's python: argv[1] is the manifest the parent wrote. Writes <out>/<case>_{logits,conf}.npy and
# <out>/report.json (per case: checkpoint keys speculators did not take, tensors not loaded as saved, anchors used).
CHILD = r'''
import json, sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

import speculators.models.dflash.core as dflash_core
import speculators.models.dspark.core as dspark_core
from speculators import SpeculatorModel, SpeculatorModelConfig

man = json.loads(Path(sys.argv[1]).read_text())
b = np.load(man["batch"])
out = Path(man["out"])
t = lambda name: torch.from_numpy(b[name])

vc = Qwen3Config(vocab_size=man["vocab"], hidden_size=man["hidden"], num_hidden_layers=man["target_layers"],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                 max_position_embeddings=512, tie_word_embeddings=False)
verifier = Qwen3ForCausalLM(vc)
with torch.no_grad():
    verifier.model.embed_tokens.weight.copy_(t("embed_VD"))
    verifier.lm_head.weight.copy_(t("lm_head_VD"))
    verifier.model.norm.weight.copy_(t("final_norm_D"))
verifier.save_pretrained(man["verifier"])

seen = {}
select_anchors = dflash_core.select_anchors
def recording_select(loss_mask, num_anchors, block_size):
    anchors, valid = select_anchors(loss_mask, num_anchors, block_size)
    seen["anchors"], seen["valid"] = anchors.clone(), valid.clone()
    return anchors, valid
def capture(logits, targets, confidence_logits, *args, **kwargs):
    seen["logits"], seen["conf"] = logits.detach(), confidence_logits
    return logits.new_zeros(()), {}
dflash_core.select_anchors = recording_select
dspark_core.compute_metrics = capture

report = {"env": {p: version(p) for p in ("speculators", "transformers", "torch")}, "cases": {}}
N = len(b["anchor_flat_N"])
for case in man["cases"]:
    d = case["dir"]
    seen.clear()
    config = SpeculatorModelConfig.from_pretrained(d)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(d, config=config, dtype=torch.float32).eval()
    sd = model.state_dict()
    with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    reloaded = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    with torch.no_grad():
        model(hidden_states=t("ctx_feats_TF")[None], input_ids=t("input_ids_T")[None],
              loss_mask=t("loss_mask_T")[None], verifier_last_hidden_states=t("final_hidden_TD")[None],
              document_ids=t("document_T")[None], position_ids=t("position_T")[None], max_anchors=N)
    K = model.block_size
    np.save(out / f"{case['name']}_logits.npy", seen["logits"][0].reshape(N, K, -1).float().numpy())
    if seen["conf"] is not None:
        np.save(out / f"{case['name']}_conf.npy", seen["conf"][0].reshape(N, K).float().numpy())
    report["cases"][case["name"]] = {
        "type": type(model).__name__, "attn": model._attn_impl,
        "unexpected": sorted(set(saved) - set(sd)), "missing": sorted(set(sd) - set(saved) - reloaded),
        "not_as_saved": sorted(k for k in set(saved) & set(sd) if not torch.equal(saved[k], sd[k])),
        "verifier_embed_ok": bool(torch.equal(sd["embed_tokens.weight"], t("embed_VD"))),
        "verifier_lm_head_ok": bool(torch.equal(sd["lm_head.weight"], t("lm_head_VD"))),
        "verifier_norm_ok": bool(torch.equal(sd["verifier_norm.weight"], t("final_norm_D"))),
        "anchors_ok": bool(torch.equal(seen["anchors"], t("anchor_flat_N")) and seen["valid"].all()),
        "conf": seen["conf"] is not None}
(out / "report.json").write_text(json.dumps(report, indent=1))
'''


def make_target(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"embed_VD": torch.randn(V, D, generator=g) * 0.5, "lm_head_VD": torch.randn(V, D, generator=g) * D ** -0.5,
            "final_norm_D": 1 + 0.2 * torch.randn(D, generator=g)}


def make_batch(g: torch.Generator, block_size: int) -> BlockBatch:
    T = sum(SEQ_LENS)
    ids = torch.randint(0, V, (T,), generator=g)
    ids[ids == MASK_ID] = MASK_ID + 1  # the mask token never occurs in the data, as chosen at launch
    seq = torch.tensor([s for s, _ in BLOCKS])
    anchor = torch.tensor([p for _, p in BLOCKS])
    k = torch.arange(block_size)
    return BlockBatch(input_ids_T=ids, ctx_feats_TF=torch.randn(T, len(CONTEXT_LAYERS) * D, generator=g),
                      final_hidden_TD=torch.randn(T, D, generator=g),
                      seq_start_S1=torch.tensor([0] + SEQ_LENS).cumsum(0), block_seq_N=seq, anchor_pos_N=anchor,
                      valid_NK=anchor[:, None] + k[None, :] + 1 < torch.tensor(SEQ_LENS)[seq][:, None])


def speculators_inputs(batch: BlockBatch) -> dict[str, np.ndarray]:
    """The same batch in speculators' packed form: one row, per-document ids and positions, anchors marked."""
    T = batch.input_ids_T.shape[0]
    lengths = batch.seq_start_S1[1:] - batch.seq_start_S1[:-1]
    document_T = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    loss_mask_T = torch.zeros(T, dtype=torch.long)
    loss_mask_T[batch.anchor_index_N()] = 1
    return {"input_ids_T": batch.input_ids_T, "ctx_feats_TF": batch.ctx_feats_TF,
            "final_hidden_TD": batch.final_hidden_TD, "document_T": document_T,
            "position_T": torch.arange(T) - batch.seq_start_S1[document_T], "loss_mask_T": loss_mask_T,
            "anchor_flat_N": batch.anchor_index_N()}


def perturbed_draft(preset: str, overrides: dict, target: dict[str, torch.Tensor], g: torch.Generator):
    cfg = draft_preset(preset)
    for name, value in {**SMALL, **overrides}.items():
        setattr(cfg, name, value)
    model = build_draft(cfg, target["embed_VD"], target["lm_head_VD"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name == "head.w2_RV":  # initialised to zero: a zero W2 would hide the Markov bias entirely
                p.copy_(0.5 * noise)
            else:
                p.add_(0.05 * noise)
    return model.eval()


def our_logits(model, batch: BlockBatch) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        out = model(batch)
        logits_NKV = out.hidden_NKD @ model.lm_head_weight().t()
        if out.head_factor_NKR is not None:
            logits_NKV = logits_NKV + out.head_factor_NKR @ model.head_w2()
    return logits_NKV.numpy(), out.conf_logit_NK.numpy()


def edit_export(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of a speculators export with config fields replaced (dotted names reach into nested sections; a
    callable maps the old value) and/or tensors rewritten by `tensors(state)`."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    for dotted, value in (config or {}).items():
        *parents, leaf = dotted.split(".")
        section = cfg
        for name in parents:
            section = section[name]
        section[leaf] = value(section[leaf]) if callable(value) else value
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    state = load_file(str(src / "model.safetensors"))
    save_file(tensors(state) if tensors else state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def qk_norm_ones(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in state.items()}


def joint_cand_gate_out(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(state)
    for p in ("weight", "bias"):
        gate, cand, o = state[f"markov_head.joint_proj.{p}"].chunk(3)
        out[f"markov_head.joint_proj.{p}"] = torch.cat([cand, gate, o])
    return out


SWA = "markov-swa6-theta5e5"
LAYER = "transformer_layer_config"
CONTROLS = {  # name: (variant, config fields, tensor rewrite)
    "qk-norm-ones": ("dspark-markov", None, qk_norm_ones),
    "sample_from_anchor=false": ("dspark-markov", {"sample_from_anchor": False}, None),
    "sliding_window_non_causal=false": (SWA, {"sliding_window_non_causal": False}, None),
    "window-dropped": (SWA, {f"{LAYER}.layer_types": lambda t: ["full_attention"] * len(t),
                             f"{LAYER}.use_sliding_window": False}, None),
    "rope_theta=1e4": (SWA, {f"{LAYER}.rope_theta": 1e4, f"{LAYER}.rope_parameters.rope_theta": 1e4}, None),
    "rnn-joint-cand-gate-out": ("dspark-rnn", None, joint_cand_gate_out),
}


def run_child(python: Path, work: Path, cases: list[dict], arrays: dict[str, np.ndarray]) -> dict:
    np.savez(work / "batch.npz", **arrays)
    (work / "out").mkdir()
    manifest = {"batch": str(work / "batch.npz"), "out": str(work / "out"), "verifier": str(work / "verifier"),
                "vocab": V, "hidden": D, "target_layers": NUM_TARGET_LAYERS, "cases": cases}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (work / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(python), str(work / "child.py"), str(work / "manifest.json")], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        print(f"speculators_roundtrip: the speculators child failed (rc {proc.returncode}); its output is on stderr")
        sys.exit(1)
    return json.loads((work / "out" / "report.json").read_text())


def compare(work: Path, name: str, ours: tuple[np.ndarray, np.ndarray]) -> tuple[float, float, float, float]:
    """-> (max |dlogit|, max |dconf| (nan when speculators built no confidence head), argmax agreement, logit scale)."""
    theirs = np.load(work / "out" / f"{name}_logits.npy")
    conf = work / "out" / f"{name}_conf.npy"
    dconf = float(np.abs(np.load(conf) - ours[1]).max()) if conf.exists() else float("nan")
    return (float(np.abs(theirs - ours[0]).max()), dconf, float((theirs.argmax(-1) == ours[0].argmax(-1)).mean()),
            float(np.abs(ours[0]).max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default="/root/specvenv", help="venv holding speculators 0.9.0 (outside the repo)")
    ap.add_argument("--keep", default=None, help="work in this (new) directory and keep it, instead of a temp dir")
    args = ap.parse_args()
    python = Path(args.venv) / "bin" / "python"
    if not python.is_file():
        print(f"speculators_roundtrip: no speculators venv at {args.venv}; create it with: "
              + VENV_RECIPE.format(v=args.venv))
        sys.exit(2)
    if args.keep and Path(args.keep).exists():
        ap.error(f"--keep {args.keep} exists; name a new directory")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    target = make_target(g)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)  # (--keep: checked above to be new)
        facts = {"num_hidden_layers": NUM_TARGET_LAYERS, "max_position_embeddings": 512,
                 "architectures": ["Qwen3ForCausalLM"], "name_or_path": str(work / "verifier")}
        batch, ours, cases, exports = None, {}, [], {}
        for name, (preset, overrides) in VARIANTS.items():
            model = perturbed_draft(preset, overrides, target, g)
            batch = batch if batch is not None else make_batch(g, model.cfg.block_size)
            assert model.cfg.block_size == batch.block_size, "variants share one batch"
            ours[name] = our_logits(model, batch)
            ckpt = export_draft(model.state_dict(), {"draft": model.cfg.to_dict(), "target": "random"},
                                work / "ours" / name)
            exports[name] = write_engine_export(ckpt, "speculators", work / "speculators" / name, facts)
            cases.append({"name": name, "dir": str(exports[name])})
        for name, (variant, config, tensors) in CONTROLS.items():
            ctl = edit_export(exports[variant], work / "controls" / name, config, tensors)
            cases.append({"name": name, "dir": str(ctl)})
        arrays = {k: v.numpy() for k, v in speculators_inputs(batch).items()}
        arrays.update({k: v.numpy() for k, v in target.items()})
        report = run_child(python, work, cases, arrays)

        env, loaded = report["env"], report["cases"]
        print(f"speculators {env['speculators']} (transformers {env['transformers']}, torch {env['torch']}) loaded "
              f"{len(loaded)} exports as {sorted({r['type'] for r in loaded.values()})}, "
              f"attention {sorted({r['attn'] for r in loaded.values()})}")
        clean = True
        for name, r in loaded.items():
            problems = {k: r[k] for k in ("unexpected", "missing", "not_as_saved") if r[k]}
            problems.update({k: False for k in ("verifier_embed_ok", "verifier_lm_head_ok", "verifier_norm_ok",
                                                 "anchors_ok") if not r[k]})
            if problems:
                clean = False
                print(f"{name}: speculators load problems: {problems}")
        if clean:
            print("every exported tensor loaded as saved, none missing; embed_tokens, lm_head and verifier_norm "
                  "reloaded from the verifier; speculators used our anchors")
        print(f"{'variant':<22}{'max|dlogit|':>12}{'logit scale':>12}{'max|dconf|':>12}{'argmax':>9}  result")
        dlogits, dconfs = [], []
        for name in VARIANTS:
            dl, dc, agree, scale = compare(work, name, ours[name])
            ok = dl <= TOL and dc <= TOL  # a nan (no confidence head loaded) fails
            dlogits.append(dl)
            dconfs.append(dc)
            print(f"{name:<22}{dl:>12.2e}{scale:>12.2f}{dc:>12.2e}{agree:>8.1%}  {'pass' if ok else 'FAIL'}")
        caught = 0
        for name, (variant, _, _) in CONTROLS.items():
            dl, dc, agree, _ = compare(work, name, ours[variant])
            hit = dl > TOL or dc > TOL  # a real difference measured (a nan is no catch)
            caught += hit
            print(f"control {name} (on {variant}): max|dlogit|={dl:.3g} max|dconf|={dc:.3g} argmax={agree:.1%} "
                  f"{'caught' if hit else 'NOT CAUGHT'}")
    n = len(VARIANTS)
    passed = sum(dl <= TOL and dc <= TOL for dl, dc in zip(dlogits, dconfs))
    print(f"speculators_roundtrip variants={n} max_abs_dlogit={np.max(dlogits):.2e} "  # np.max: a nan shows
          f"max_abs_dconf={np.max(dconfs):.2e} pass={passed}/{n} control_caught={caught}/{len(CONTROLS)}")
    sys.exit(0 if passed == n and caught == len(CONTROLS) else 1)


if __name__ == "__main__":
    main()
