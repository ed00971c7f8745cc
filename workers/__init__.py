"""The processes of a run: the driver, the frozen target (target/) and the draft trainers (trainer/)
(docs/architecture.md). Ray, DeepSpeed and torch.distributed are used here, never below."""

import torch as _torch

from pipeline.metrics import drop_log_message as _drop_log_message

if not _torch.cuda.is_available():
    # DeepSpeed says this on its first import in every process (driver, target workers, each trainer) when it picks
    # its CPU accelerator: with no CUDA device there is nothing else to pick, and the trainer's first line says which
    # device and dtype run. Installed here, before any module of a process of ours imports deepspeed.
    _drop_log_message("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable "
                                   "to detect it.")
