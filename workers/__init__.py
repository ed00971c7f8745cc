"""The processes of a run: the driver, the frozen target (target/) and the draft trainers (trainer/)
(docs/architecture.md). Ray, DeepSpeed and torch.distributed are used here, never below."""
