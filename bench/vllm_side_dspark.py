"""The vLLM side of bench/serve_vllm.py --method dspark: speculative decoding with a DSpark draft (vLLM's own
`dspark` method, Model Runner V2, its DSpark speculator), one request at a time, recording every round: the drafted
block, the accepted count and the confidence vLLM's model computes for each drafted slot. Runs in the vLLM
environment's python with the Triton interpreter stand-in on (launch/make_vllm_env.py installs it for the CPU build;
DSPARK_TRITON_INTERPRETER=1 activates it) and imports only vllm, torch, json and the standard library (the project
never imports vllm; bench/serve_vllm.py starts this script in a subprocess):

    DSPARK_TRITON_INTERPRETER=1 VLLM_USE_V2_MODEL_RUNNER=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 \
        ~/.cache/dspark/vllm-0.32.0/bin/python bench/vllm_side_dspark.py REQUEST.json RESULT.json

REQUEST.json: {"target": model dir, "draft": deepspec or speculators export dir, "gamma": num_speculative_tokens,
"max_new_tokens": M, "prompts": [[token ids], ...], "temperature": T, "samples": S (T > 0: S seeded samples of
each prompt)}. RESULT.json: per (prompt, sample) the output token ids and the rounds [accepted, [drafted ids],
[confidences]] in order, plus vLLM's spec-decode counters (llm.get_metrics()).

Where V2 keeps a round (the scheduler sees only -1 placeholder drafts under V2, so bench/vllm_side_dflash.py's
reading of SchedulerOutput records nothing here):
- the drafted tokens: `DSparkSpeculator.draft_tokens` right after `_sample_sequential` (vllm/v1/worker/gpu/
  spec_decode/dspark/speculator.py), the speculator's own buffer, in the target vocabulary;
- the confidences: vLLM's `compute_confidence` (= sigmoid(confidence_head([hidden; markov_embed]))), called from
  the same wrapper on the speculator's own head hidden states (`head_hidden[sample_indices]`, as _sample_sequential
  reads them) and `markov_embed` of the previous token (the anchor, then the drafted ones), exactly the inputs
  _sample_sequential hands it when adaptive verification is on (it is refused on CPU: it needs full CUDA graphs);
- the accepted count: the scheduler's `make_spec_decoding_stats` (vllm/v1/core/sched/scheduler.py), once per
  request per step, as for dflash.
Each step drafts after verifying, so a request's last draft may never be verified: drafts beyond the counted
rounds are dropped (at most one per request, checked).
"""

from __future__ import annotations

import json
import sys


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched import scheduler as sched
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    drafts: list[tuple[list[int], list[float]]] = []
    stats: list[int] = []
    original_sample, original_stats = DSparkSpeculator._sample_sequential, sched.Scheduler.make_spec_decoding_stats

    def sample_sequential(self, num_reqs, head_hidden):
        original_sample(self, num_reqs, head_hidden)
        assert num_reqs == 1, "one request at a time"
        n_spec = self.num_speculative_steps
        tokens = self.draft_tokens[:num_reqs, :n_spec].clone()
        conf: list[float] = []
        if self.model.model.confidence_head is not None:
            with torch.no_grad():
                hidden = head_hidden[self.sample_indices[: num_reqs * n_spec]]
                anchor = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]]
                prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)  # (req, step), as _sample_sequential
                markov = self.model.markov_embed(prev.flatten())
                conf = self.model.compute_confidence(hidden, markov).view(num_reqs, n_spec)[0].float().tolist()
        drafts.append(([int(t) for t in tokens[0].tolist()], conf))

    def recording(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                  request_id):
        if num_draft_tokens:
            stats.append(int(num_accepted_tokens))
        return original_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                              num_invalid_spec_tokens, request_id)

    DSparkSpeculator._sample_sequential = sample_sequential
    sched.Scheduler.make_spec_decoding_stats = recording
    longest = max(len(p) for p in req["prompts"]) + req["max_new_tokens"] + req["gamma"] + 8
    llm = LLM(model=req["target"], dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False,
              max_model_len=max(512, longest), kv_cache_memory_bytes=1 << 30,
              speculative_config={"method": "dspark", "model": req["draft"],
                                  "num_speculative_tokens": req["gamma"]})
    temperature = float(req.get("temperature", 0.0))
    samples = int(req.get("samples", 1)) if temperature > 0 else 1
    out = []
    for i, ids in enumerate(req["prompts"]):
        for s in range(samples):
            d0, s0 = len(drafts), len(stats)
            params = SamplingParams(temperature=temperature, max_tokens=req["max_new_tokens"],
                                    seed=1000 * i + s if temperature > 0 else None)
            res = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            mine, counted = drafts[d0:], stats[s0:]
            if not len(counted) <= len(mine) <= len(counted) + 1:
                raise RuntimeError(f"prompt {i}: {len(mine)} drafts recorded for {len(counted)} verified rounds")
            out.append({"prompt": i, "sample": s, "tokens": list(res.outputs[0].token_ids),
                        "rounds": [[n, block, conf] for n, (block, conf) in zip(counted, mine)]})
    metrics = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            metrics[m.name] = getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
    with open(result_path, "w") as f:
        json.dump({"prompts": out, "metrics": metrics}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
