"""How one request's hidden states travel from vLLM's worker process (the connector) to the engine actor.

Two transports, chosen by `kv_connector_extra_config["transport"]`:
- "shm" (the default): the connector copies the request's `[T, K, D]` states and its `[T]` token ids into one POSIX
  shared-memory segment (raw bytes after a 4-int64 header), the engine actor copies them out and unlinks it. No
  file format, no disk: the states cross the process boundary once, through memory both processes map.
- "file": vLLM's own format, one safetensors file per request ({hidden_states, token_ids}), as vLLM's
  ExampleHiddenStatesConnector writes it; the fallback where shared memory is small or absent.

Either way the connector holds an exclusive flock on `<path>.lock` (created by vLLM's connector before the request's
path reaches the client) until the states are written; the reader takes a shared lock first, so it never sees a
half-written request. The path is the one vLLM returns in `RequestOutput.kv_transfer_params["hidden_states_path"]`.
Imports: stdlib, numpy, torch, safetensors only.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np
import torch

TRANSPORTS = ("shm", "file")
_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
_CODES = {v: k for k, v in _DTYPES.items()}
_HEADER = 4  # int64s: T, K, D, dtype code


STORAGE_PREFIX = "dspark-vllm-hs-"  # + the engine actor's pid + "-": one lock directory per engine
SEGMENT_PREFIX = "dspark_hs_"


def storage_dir() -> str:
    """A new lock directory for this engine process, named by its pid so a later engine can clean up after it."""
    import tempfile

    return tempfile.mkdtemp(prefix=f"{STORAGE_PREFIX}{os.getpid()}-")


def segment_name(path: str) -> str:
    """The shared-memory name of a request's path: the engine's pid and a hash, so replicas (whose request ids
    repeat: "0", "1", ...) never collide, and what a killed engine left behind can be told apart."""
    pid = Path(path).parent.name.removeprefix(STORAGE_PREFIX).split("-")[0]
    return f"{SEGMENT_PREFIX}{pid}_" + hashlib.sha1(path.encode()).hexdigest()[:20]


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> int:
    """Remove the lock directories and shared-memory segments of engines that died before handing their states
    over (a SIGKILLed actor runs no cleanup); returns how many were removed."""
    import shutil
    import tempfile

    removed = 0
    for d in Path(tempfile.gettempdir()).glob(f"{STORAGE_PREFIX}*"):
        if not _alive(d.name.removeprefix(STORAGE_PREFIX).split("-")[0]):
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    shm = Path("/dev/shm")
    for seg in shm.glob(f"{SEGMENT_PREFIX}*") if shm.is_dir() else []:
        if not _alive(seg.name.removeprefix(SEGMENT_PREFIX).split("_")[0]):
            seg.unlink(missing_ok=True)
            removed += 1
    return removed


def write_states(path: str, transport: str, states_TKD: torch.Tensor, token_ids_T: torch.Tensor) -> None:
    """Hand one request's states over (called by the connector in vLLM's worker process)."""
    states_TKD = states_TKD.detach().to("cpu").contiguous()
    token_ids_T = token_ids_T.to("cpu", torch.int64).contiguous()
    if transport == "file":
        from safetensors.torch import save_file

        save_file({"hidden_states": states_TKD, "token_ids": token_ids_T}, path)
        return
    T, K, D = states_TKD.shape
    payload = states_TKD.view(torch.uint8).numpy().reshape(-1)
    ids = token_ids_T.numpy()
    seg = shared_memory.SharedMemory(name=segment_name(path), create=True,
                                     size=_HEADER * 8 + payload.nbytes + ids.nbytes)
    try:
        # the reader owns the segment from here: without this, this process's resource tracker unlinks it at exit
        resource_tracker.unregister(seg._name, "shared_memory")  # noqa: SLF001 - Python 3.11 has no track=False
        buf = np.ndarray((seg.size,), dtype=np.uint8, buffer=seg.buf)
        buf[:_HEADER * 8] = np.array([T, K, D, _CODES[states_TKD.dtype]], dtype=np.int64).view(np.uint8)
        buf[_HEADER * 8:_HEADER * 8 + payload.nbytes] = payload
        buf[_HEADER * 8 + payload.nbytes:] = ids.view(np.uint8)
        del buf
    finally:
        seg.close()


def read_states(path: str, transport: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(states_TKD, token_ids_T) of one request, waiting for the writer's lock; removes what was handed over."""
    lock = path + ".lock"
    with open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the connector has written the states
        if transport == "file":
            from safetensors.torch import load_file

            data = load_file(path, device="cpu")
            os.remove(path)
            states, ids = data["hidden_states"], data["token_ids"]
        else:
            seg = shared_memory.SharedMemory(name=segment_name(path))
            try:
                head = np.frombuffer(seg.buf, dtype=np.int64, count=_HEADER)
                T, K, D, code = (int(x) for x in head)
                dtype = _DTYPES[code]
                nbytes = T * K * D * torch.empty((), dtype=dtype).element_size()
                raw = bytearray(seg.buf[_HEADER * 8:_HEADER * 8 + nbytes])
                states = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(T, K, D)
                ids = torch.from_numpy(np.frombuffer(bytes(seg.buf[_HEADER * 8 + nbytes:]), dtype=np.int64).copy())
                del head
            finally:
                seg.close()
                seg.unlink()
    os.remove(lock)
    return states, ids
