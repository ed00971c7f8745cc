"""The vLLM side of bench/scheduler_vllm.py: vLLM 0.32.0's own adaptive-verification scheduler
(vllm/v1/worker/gpu/spec_decode/adaptive_verification.py) driven step by step on given confidences. Runs in the vLLM
environment's python and imports only vllm, torch, numpy, json and the standard library (the project never imports
vllm; bench/scheduler_vllm.py starts this script in a subprocess):

    ~/.cache/dspark/vllm-0.32.0/bin/python bench/vllm_side_scheduler.py REQUEST.json RESULT.json

What runs is vLLM's code, in the order its model runner calls it (model_runner.py:1201-1202, 1317-1319, 1436-1438,
2258-2261): AdaptiveVerificationManager.__init__, batches_to_profile (sets the cudagraph limit), set_cost_curves
(build_cost_tables_from_curves), and per engine step add_request for new requests, get_num_tokens (the draft
budget from the stale confidences in its double buffer), sort_batch_req_ids and reallocate_drafts (admission,
_assign_draft_token_budget, torch.compile'd as vLLM runs it unless the request says "compiled": false), then
record_confidences with the confidences of the drafts the step proposed. max_total_logits is vLLM's
get_max_chunk_logits(vocab_size), as the runner passes it (model_runner.py:687).

What is stood in for, because it needs CUDA or a whole engine and holds no scheduling logic:
- torch.cuda.Stream / Event / current_stream / set_stream: no-op stand-ins (on CPU every copy has completed when it
  returns, so waiting on a copy event is a no-op);
- the RequestState: a namespace with the fields the manager reads (req_id_to_index, num_computed_tokens_np,
  prefill_len.np, max_num_reqs, max_num_batched_tokens, num_speculative_steps, device), set from the request;
- get_tp_group(): one rank, whose broadcast_object returns its argument;
- the InputBatch given to record_confidences: its num_reqs and idx_mapping.

REQUEST.json: {"num_speculative_steps": K, "max_num_reqs": R, "max_num_batched_tokens": T, "vocab_size": V,
"compiled": bool, "capture_sizes": [...], "draft_curve": [[n, ms], ...], "verify_curve": [[b, ms], ...],
"steps": [{"add": [[req_id, req_idx, prefill_len], ...], "scheduled": [[req_id, num_tokens, num_drafts,
num_computed_tokens], ...] (the scheduler's order), "proposed": [[req_id, [K confidences]], ...]}, ...]}.
RESULT.json: {"draft_ms", "verify_ms", "max_total_logits", "cudagraph_limit", "steps": [{"budget": b or null (no
drafts scheduled), "stale": {req_id: [K]} (what get_num_tokens read), "admitted": {req_id: n}}, ...]}.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch

# PyPI's CUDA builds of these fail to load beside the CPU torch ("operator torchvision::nms does not exist");
# launch/make_vllm_env.py uninstalls them, and vLLM's config import reaches them through transformers. The scheduler
# needs none of them, so this script hides them, and runs in an environment where they were left installed too.
MEDIA = ("torchvision", "torchaudio", "torchcodec")

class _NoCuda:
    """Stands in for a CUDA stream or event on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass


def _patch_cuda() -> None:
    torch.cuda.Stream = _NoCuda
    torch.cuda.Event = _NoCuda
    torch.cuda.current_stream = lambda *args, **kwargs: _NoCuda()
    torch.cuda.set_stream = lambda *args, **kwargs: None


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    for name in MEDIA:
        sys.modules.setdefault(name, None)  # `import torchvision` now raises ImportError: transformers goes without
    _patch_cuda()
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import get_max_chunk_logits

    if not req.get("compiled", True):
        av._assign_draft_token_budget_compiled = av._assign_draft_token_budget
    av.get_tp_group = lambda: SimpleNamespace(broadcast_object=lambda obj, src=0: obj)
    K, max_reqs = req["num_speculative_steps"], req["max_num_reqs"]
    states = SimpleNamespace(num_speculative_steps=K, device=torch.device("cpu"), max_num_reqs=max_reqs,
                             max_num_batched_tokens=req["max_num_batched_tokens"], req_id_to_index={},
                             num_computed_tokens_np=np.zeros(max_reqs, dtype=np.int32),
                             prefill_len=SimpleNamespace(np=np.zeros(max_reqs, dtype=np.int32)))
    max_total_logits = get_max_chunk_logits(req["vocab_size"])
    manager = av.AdaptiveVerificationManager(states, torch.zeros(max_reqs + 1, dtype=torch.int32),
                                             num_bonus_tokens=1, max_total_logits=max_total_logits)
    for _ in manager.batches_to_profile(req["capture_sizes"]):
        pass
    manager.set_cost_curves([tuple(p) for p in req["draft_curve"]], [tuple(p) for p in req["verify_curve"]])
    draft_ms, verify_ms = manager.cost_tables
    out = []
    for step in req["steps"]:
        for req_id, idx, prefill_len in step["add"]:
            states.req_id_to_index[req_id] = idx
            states.prefill_len.np[idx] = prefill_len
            manager.add_request(idx)
        num_tokens = {r: n for r, n, _, _ in step["scheduled"]}
        drafts = {r: [0] * d for r, _, d, _ in step["scheduled"] if d}  # placeholders: only their count is read
        for r, _, _, computed in step["scheduled"]:
            states.num_computed_tokens_np[states.req_id_to_index[r]] = computed
        req_ids = model_runner.sort_batch_req_ids(num_tokens, drafts, K + 1)
        idx_mapping = torch.tensor([states.req_id_to_index[r] for r in req_ids], dtype=torch.int64)
        record = {"budget": None, "stale": {}, "admitted": {}}
        if drafts:
            stale = manager._stale_confidences[manager._stale_idx].np
            record["stale"] = {r: stale[states.req_id_to_index[r]].tolist() for r in drafts}
            manager.get_num_tokens(num_tokens, drafts)
            record["budget"] = int(manager._batch_budget[2])
            manager.reallocate_drafts(req_ids, idx_mapping)
            admitted = manager._batch_draft_capacity[:len(req_ids)].tolist()
            record["admitted"] = {r: int(n) for r, n in zip(req_ids, admitted)}
        proposed = dict((r, c) for r, c in step["proposed"])
        manager.record_confidences(torch.tensor([proposed[r] for r in req_ids], dtype=torch.float32),
                                   SimpleNamespace(num_reqs=len(req_ids), idx_mapping=idx_mapping))
        out.append(record)
    with open(result_path, "w") as f:
        json.dump({"draft_ms": draft_ms.tolist(), "verify_ms": verify_ms.tolist(), "max_total_logits": max_total_logits,
                   "cudagraph_limit": manager._cudagraph_limit, "steps": out}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
