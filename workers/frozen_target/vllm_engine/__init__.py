"""Code that runs inside the vLLM environment (its own Python, chosen per actor by Ray's runtime_env): the engine
actor (engine), our KV connector (connector) and the hand-off of hidden states between them (transfer).

These modules import only the standard library, numpy, torch, safetensors and (lazily, in the engine and the
connector) vllm: nothing from pipeline/, draft_model/ or the rest of workers/, so this package loads in an
environment that has vLLM's pins and not ours (tests/test_layering.py). The client on our side is
workers/frozen_target/vllm_worker.py; docs/vllm-target.md explains the whole path.
"""
