"""The vLLM side of bench/serve_vllm.py: greedy speculative decoding with a `dflash` draft, one request at a time,
recording every verification round. Runs in the vLLM environment's python and imports only vllm, torch, json and
the standard library (the project never imports vllm; bench/serve_vllm.py starts this script in a subprocess):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=1 \
        ~/.cache/dspark/vllm-0.32.0/bin/python bench/vllm_side_dflash.py REQUEST.json RESULT.json

REQUEST.json: {"target": model dir, "draft": DFlash export dir, "gamma": num_speculative_tokens,
"max_new_tokens": M, "prompts": [[token ids], ...]}. RESULT.json: per prompt the output token ids and the rounds,
[accepted, [drafted token ids]] in order; plus vLLM's own spec-decode counters from llm.get_metrics(), which the
rounds must sum to. vLLM exposes acceptance only as counters, so the rounds come from a wrapper around the scheduler's
`make_spec_decoding_stats` (vllm/v1/core/sched/scheduler.py:2129-2135), called once per request per step with that
step's drafted and accepted counts, and the drafted tokens from the step's SchedulerOutput
(`scheduled_spec_decode_tokens`, read by a wrapper around `update_from_output`): the engine core must run in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import json
import sys


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched import scheduler as sched

    log: list[tuple[int, list[int]]] = []
    step: dict = {}  # the drafted tokens of the step being recorded: request id -> token ids
    original_stats, original_update = sched.Scheduler.make_spec_decoding_stats, sched.Scheduler.update_from_output

    def update(self, scheduler_output, model_runner_output):
        step["spec"] = scheduler_output.scheduled_spec_decode_tokens
        return original_update(self, scheduler_output, model_runner_output)

    def recording(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                  request_id):
        if num_draft_tokens:
            invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
            drafted = list(step.get("spec", {}).get(request_id, []))[:num_draft_tokens - invalid]
            log.append((int(num_accepted_tokens), [int(t) for t in drafted]))
        return original_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                              num_invalid_spec_tokens, request_id)

    sched.Scheduler.update_from_output = update
    sched.Scheduler.make_spec_decoding_stats = recording
    longest = max(len(p) for p in req["prompts"]) + req["max_new_tokens"] + req["gamma"] + 8
    llm = LLM(model=req["target"], dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False,
              max_model_len=max(512, longest), kv_cache_memory_bytes=1 << 30,
              speculative_config={"method": "dflash", "model": req["draft"],
                                  "num_speculative_tokens": req["gamma"]})
    params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"])
    prompts = []
    for ids in req["prompts"]:
        start = len(log)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        prompts.append({"tokens": list(out.outputs[0].token_ids), "rounds": [list(r) for r in log[start:]]})
    metrics = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            metrics[m.name] = getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
    with open(result_path, "w") as f:
        json.dump({"prompts": prompts, "metrics": metrics}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
