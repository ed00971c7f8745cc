"""Write a trained draft in a format serving engines load (docs/serving.md, "Serving the draft").

    python launch/export_draft.py runs/tiny --format deepspec --out runs/tiny/export-deepspec
    python launch/export_draft.py runs/tiny/export --format speculators --out DIR [--target smollm2]
    python launch/export_draft.py runs/dflash --format dflash --out DIR   # draft.block_layout=bonus_anchor
    python launch/export_draft.py runs/tiny --format deepspec --draft-vocab 4096 --vocab-data DATA_DIR --out DIR
    python launch/export_draft.py runs/v4-deepseek --format gguf-dsv4 --target-gguf TARGET.gguf --out draft.gguf
    python launch/export_draft.py runs/v4-deepseek --format deepseek-v4 --out DIR [--into DEEPSEEK_V4_CHECKPOINT]

EXPORT_OR_RUN_DIR is an exported draft (config.json + model.safetensors, what every run writes to <run>/export)
or a run directory. --format deepspec: the flat Qwen3DSparkModel schema (vLLM, SGLang, TensorRT-LLM, and
llama.cpp's convert_hf_to_gguf.py); speculators: vLLM's speculators schema; dflash: vLLM's DFlash schema
(`DFlashDraftModel`, method "dflash", the one block-parallel method vLLM's CPU runner serves), which reads every block
in the bonus-anchor layout: a draft trained in another layout is refused, naming vllm/v1/spec_decode/dflash.py
(docs/vllm-serving.md). The target (its config.json: depth,
context length, name) defaults to the one the draft was trained on. A draft no engine can serve (MoE, mHC, no q/k
norm, a learned mask, the final post-norm state as context, ...) is refused with exit status 2 and one line saying
why and which preset can be served; so is a missing export or target. --draft-vocab N (deepspec): the draft
scores only the N target tokens most frequent in the replies of DATA_DIR (a data stage), through its own LM head
(the target's rows) and a d2t table, which makes its round in llama.cpp far cheaper (serving/draft_vocab.py).
--format gguf-dsv4: a v4-deepseek draft
(arch dsv4, DeepSeek-V4's drafter block) as the GGUF llama.cpp serves with `--spec-type draft-dspark`; --out is
the file, --target-gguf the target's GGUF (llama.cpp's converter writes it), whose tokenizer the draft carries.
--format deepseek-v4: the same draft in the DeepSeek-V4 checkpoint layout (config.json of a DeepseekV4ForCausalLM
with the dspark_* keys, the mtp.<stage>.* tensors, routed experts in MXFP4), what a DeepSeek-V4 user merges into
their checkpoint and what llama.cpp's `convert_hf_to_gguf.py DIR --dspark --target-model-dir TARGET` converts;
with --into, DIR is that checkpoint with the drafter added (its files linked, its config plus the dspark_* keys, the
drafter's tensors in one more shard), refused when a hyper-parameter the drafter shares with it differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GGUF_DSV4 = "gguf-dsv4"  # serving/dsv4_gguf_export.py: one .gguf file, not an export directory


def main(argv: list[str] | None = None) -> int:
    from pipeline.export import read_export
    from serving.engine_export import (
        DEEPSEEK_V4,
        FORMATS,
        calibration_note,
        check_servable,
        target_facts,
        write_engine_export,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("export", metavar="EXPORT_OR_RUN_DIR", help="an exported draft, or a run dir holding export/")
    p.add_argument("--format", required=True, choices=(*FORMATS, GGUF_DSV4, DEEPSEEK_V4))
    p.add_argument("--out", required=True, help="directory to write (replaced); for gguf-dsv4 the .gguf file")
    p.add_argument("--target-gguf", default=None, help="gguf-dsv4 only (required): the target's GGUF")
    p.add_argument("--dtype", default="f32", choices=("f32", "f16"), help="gguf-dsv4 only: matrix precision")
    p.add_argument("--into", default=None, help="deepseek-v4 only: a DeepseekV4ForCausalLM checkpoint to add the "
                                                "drafter to (written as --out; the original is not changed)")
    p.add_argument("--target", default=None, help="target name or model directory (default: the draft's target)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="deepspec only: the draft's logits over the N target tokens most frequent in --vocab-data's "
                        "replies (its own LM head and d2t; a far cheaper draft round in llama.cpp)")
    p.add_argument("--vocab-data", default=None, metavar="DATA_DIR",
                   help="the data stage (launch/prepare_data.py's directory) whose reply tokens choose --draft-vocab")
    p.add_argument("--drop-confidence", action="store_true",
                   help="export without the confidence head (deepspec schema: a head without a Markov head)")
    args = p.parse_args(argv)
    src = Path(args.export)
    if (src / "export" / "config.json").is_file():
        src = src / "export"
    try:
        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"{args.export} is neither an exported draft nor a run directory holding export/")
        if args.format in (GGUF_DSV4, DEEPSEEK_V4):  # DeepSeek-V4's drafter: a calibration is not folded there
            note = calibration_note(src, read_export(src)[0], args.format)[1]
            if note:
                print(note)
        if args.format == GGUF_DSV4:
            if not args.target_gguf:
                raise ValueError("--format gguf-dsv4 needs --target-gguf (the target's GGUF, for its tokenizer)")
            from serving.dsv4_gguf_export import write_export_gguf
            from workers.frozen_target.target_files import check_target_files

            if read_export(src)[0].arch == "dsv4":  # another draft is refused by the writer, naming the draft
                check_target_files(Path(args.target_gguf))

            out = write_export_gguf(src, args.out, args.target_gguf, args.dtype)
            print(f"wrote {args.format} export to {out} ({out.stat().st_size / 2**20:.1f} MiB)")
            return 0
        from workers.frozen_target.model import resolve_target_path
        from workers.frozen_target.target_files import check_target_files

        if args.format in FORMATS:  # refuse an unservable draft before the target is resolved (a first use converts it)
            check_servable(read_export(src)[0], args.format, args.drop_confidence)
        target = args.target or json.loads((src / "config.json").read_text()).get("target")
        if not target:
            raise ValueError(f"{src}/config.json names no target; pass --target")
        if args.format == DEEPSEEK_V4 and args.into:
            from serving.deepseek_checkpoint import merge_into_checkpoint

            out = merge_into_checkpoint(src, args.into, args.out)
            print(f"wrote {args.format} export to {out}: {args.into} with the drafter added")
            return 0
        if args.into:
            raise ValueError("--into applies to --format deepseek-v4")
        if (args.draft_vocab is None) != (args.vocab_data is None):
            raise ValueError("--draft-vocab and --vocab-data go together: N tokens, chosen from DATA_DIR's replies")
        if args.draft_vocab is not None and args.format != "deepspec":
            raise ValueError("--draft-vocab applies to --format deepspec (draft_vocab_size + d2t, as llama.cpp's "
                             "converter reads them)")
        target_dir = resolve_target_path(target)
        if args.format != DEEPSEEK_V4:  # deepseek-v4 reads only the depth, from a checkpoint often in FP8
            check_target_files(target_dir)
        facts = target_facts(target_dir, target)
        draft_vocab = None
        if args.draft_vocab is not None:
            from serving.draft_vocab import draft_vocab_from_data

            draft_vocab = draft_vocab_from_data(target_dir, args.vocab_data, args.draft_vocab)[:2]
        if args.format == DEEPSEEK_V4:
            from serving.deepseek_checkpoint import write_deepseek_checkpoint

            out = write_deepseek_checkpoint(src, args.out, facts["num_hidden_layers"])
        else:
            out = write_engine_export(src, args.format, args.out, facts, args.drop_confidence, draft_vocab, say=print)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} export to {out}: {', '.join(sorted(f.name for f in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
