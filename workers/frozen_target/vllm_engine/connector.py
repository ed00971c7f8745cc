"""Our KV connector for vLLM's `extract_hidden_states` method: vLLM's ExampleHiddenStatesConnector with its write
replaced by a synchronous hand-off through workers/frozen_target/vllm_engine/transfer.py.

Why a subclass: the stock connector copies the states device-to-host into pinned memory on a CUDA stream, which a
CPU build refuses ("pin_memory=True requires a CUDA or other accelerator backend"), and it always writes a
safetensors file. Everything else is vLLM's: the scheduler side (which requests finished, their blocks, the path
returned in `kv_transfer_params["hidden_states_path"]`), the lock file created before that path reaches the
client, and `get_finished`, which reports a request done once its copy is (here: at once, the copy is synchronous).

Loaded by vLLM from `kv_transfer_config={"kv_connector": "DSparkHiddenStatesConnector",
"kv_connector_module_path": "workers.frozen_target.vllm_engine.connector", ...}`; runs in vLLM's worker process.
Legend: T tokens of one request, K captured layers, D hidden size.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from workers.frozen_target.vllm_engine.transfer import TRANSPORTS, write_states


class _Copied:
    """Stands for the stock connector's CUDA event: our copy finished before `get_finished` polls it."""

    @staticmethod
    def query() -> bool:
        return True


def _exit_with_parent() -> None:
    """Die with the process that started this one (Linux PR_SET_PDEATHSIG). vLLM's engine core does not watch its
    parent: when Ray SIGKILLs an engine actor (a crash, a fault test), its engine and worker processes would
    otherwise live on, holding the model's memory and their cores. The connector is built in both, so it arms it."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


class DSparkHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _exit_with_parent()
        self._transport = self._kv_transfer_config.get_from_extra_config("transport", "shm")
        if self._transport not in TRANSPORTS:
            raise ValueError(f"kv_connector_extra_config.transport must be one of {TRANSPORTS}, "
                             f"got {self._transport!r}")

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:  # every TP rank holds the same states; rank 0 hands them over
            return
        block_ids_N = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (block_ids_N[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        states_TKD = states.reshape(num_tokens, self.num_hidden_states, -1)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            write_states(pending.filename, self._transport, states_TKD, pending.token_ids)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader
        self._req_copy_events[pending.req_id] = _Copied()
