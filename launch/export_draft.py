"""Write a trained draft in a format serving engines load (docs/serving.md, "Serving the draft").

    python launch/export_draft.py runs/tiny --format deepspec --out runs/tiny/export-deepspec
    python launch/export_draft.py runs/tiny/export --format speculators --out DIR [--target smollm2]

EXPORT_OR_RUN_DIR is an exported draft (config.json + model.safetensors, what every run writes to <run>/export)
or a run directory. --format deepspec: the flat Qwen3DSparkModel schema (vLLM, SGLang, TensorRT-LLM, and
llama.cpp's convert_hf_to_gguf.py); speculators: vLLM's speculators schema. The target (its config.json: depth,
context length, name) defaults to the one the draft was trained on. A draft no engine can serve (MoE, mHC, no q/k
norm, a learned mask, the final post-norm state as context, ...) is refused with exit status 2 and one line saying
why and which preset can be served; so is a missing export or target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from serving.engine_export import FORMATS, target_facts, write_engine_export
    from workers.target.model import resolve_target_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("export", metavar="EXPORT_OR_RUN_DIR", help="an exported draft, or a run dir holding export/")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="directory to write (replaced)")
    p.add_argument("--target", default=None, help="target name or model directory (default: the draft's target)")
    p.add_argument("--drop-confidence", action="store_true",
                   help="export without the confidence head (deepspec schema: a head without a Markov head)")
    args = p.parse_args(argv)
    src = Path(args.export)
    if (src / "export" / "config.json").is_file():
        src = src / "export"
    try:
        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"{args.export} is neither an exported draft nor a run directory holding export/")
        target = args.target or json.loads((src / "config.json").read_text()).get("target")
        if not target:
            raise ValueError(f"{src}/config.json names no target; pass --target")
        out = write_engine_export(src, args.format, args.out, target_facts(resolve_target_path(target), target),
                                  args.drop_confidence)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.format} export to {out}: {', '.join(sorted(f.name for f in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
