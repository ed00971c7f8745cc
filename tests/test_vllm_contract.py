"""The vLLM backend's pieces that need no vLLM (default suite, seconds): the config keys and their one-line
errors, the options handed to vllm.LLM (parallelism included), the one layer-id mapping (our L and -1 -> the
engine's LM-head input, asked for as FINAL_AUX_ID and captured last; vLLM's DeepSeek-V4 has no id 0), the capture
plugin's wheel, the shared-memory and file hand-offs, and the FeatureBatch built on our side from the engine's
library-neutral answer.

Run: python -m pytest -q tests/test_vllm_contract.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.contracts import TokenizedSample
from workers.frozen_target.vllm_engine.capture_model import FINAL_AUX_ID
from workers.frozen_target.vllm_engine.engine import aux_layer_ids, engine_kwargs, first_aux_id, layer_features
from workers.frozen_target.vllm_engine.transfer import read_states, write_states
from workers.frozen_target.vllm_worker import VLLM_ENV_DIR, engine_actor_options, feature_batch

VLLM_PYTHON = VLLM_ENV_DIR / "bin" / "python"


def test_backend_defaults_to_transformers_and_bad_values_are_one_line():
    assert load_config(None).target.backend == "transformers"
    assert load_config(None, ["target.backend=vllm"]).target.backend == "vllm"
    for override, match in [("target.backend=sglang", "target.backend"),
                            ("target.vllm_executor=ray", "target.pp_size and target.vllm_executor are vLLM's"),
                            ("target.vllm_transport=nfs", "target.vllm_transport"),
                            ("target.vllm_executor=slurm", "target.vllm_executor")]:
        with pytest.raises((ValueError, ConfigError), match=match) as e:
            load_config(None, [override])
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="target.pp_size must be 1: vLLM 0.32's hidden-states capture"):
        load_config(None, ["target.backend=vllm", "target.pp_size=2"])
    with pytest.raises(ValueError, match="max_tokens_per_forward .* must be >= data.max_len"):
        load_config(None, ["target.backend=vllm", "data.max_len=512", "target.max_tokens_per_forward=256"])
    with pytest.raises(ValueError, match="device_map must be empty with target.backend=vllm"):
        load_config(None, ["target.backend=vllm", "target.device_map=auto"])


def _target(**over) -> dict:
    cfg = load_config(None, ["target.backend=vllm", *[f"target.{k}={v}" for k, v in over.items()]])
    return {**cfg.target.__dict__, "resolved_path": "/models/x"}


def test_parallelism_and_capture_settings_reach_the_engine_arguments():
    # pp_size > 1 is refused by the config (vLLM 0.32's capture); the argument still reaches vLLM as given
    t = {**_target(tp_size=8, expert_parallel="true", vllm_executor="ray", gpus_per_worker=1), "pp_size": 2}
    kw = engine_kwargs(t, [2, 15, FINAL_AUX_ID], "/tmp/x")
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (8, 2)
    assert kw["enable_expert_parallel"] is True and kw["distributed_executor_backend"] == "ray"
    assert kw["enable_prefix_caching"] is False  # a capture never comes from cached blocks
    assert kw["max_num_batched_tokens"] >= t["max_tokens_per_forward"] >= 512  # data.max_len fits one step
    spec = kw["speculative_config"]
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, -1]
    assert kw["kv_transfer_config"]["kv_connector_module_path"] == "workers.frozen_target.vllm_engine.connector"
    assert kw["kv_transfer_config"]["kv_connector_extra_config"]["transport"] == "shm"
    assert engine_kwargs(_target(), [30], "/tmp/x")["distributed_executor_backend"] is None  # vLLM's choice
    plain = engine_kwargs(_target(), None)  # the data stage's generation engine: no capture
    assert "speculative_config" not in plain and "kv_transfer_config" not in plain and plain["seed"] == 0
    # vLLM's "mp" executor: the actor holds all tp x pp ranks' GPUs and custom resources (both per engine rank)
    mp = {**t, "vllm_executor": "mp", "vllm_python": __import__("sys").executable,
          "resources_per_worker": {"target_worker": 1}}
    opts = engine_actor_options(mp)
    assert opts["num_gpus"] == 16 and opts["resources"] == {"target_worker": 16} and opts["max_task_retries"] == -1
    assert opts["runtime_env"]["py_executable"] == mp["vllm_python"]


def test_vllms_ray_executor_gets_a_placement_group_of_target_bundles():
    """With vllm_executor=ray the engine actor sits in bundle 0 of a group of one bundle per engine rank (its GPU
    and the target nodes' custom resource), capturing child actors: the group vLLM then finds and fills
    (vllm/engine/arg_utils.py: create_engine_config, in the engine actor), instead of bare GPU bundles that could
    land on the trainers' GPUs. Checked on a local Ray with logical GPUs."""
    import sys

    import ray
    from ray.util.placement_group import remove_placement_group

    from workers.frozen_target.vllm_worker import engine_bundles, engine_placement_group

    t = {**_target(tp_size=4, vllm_executor="ray", gpus_per_worker=1, cpus_per_worker=1),
         "resources_per_worker": {"target_worker": 1}, "vllm_python": sys.executable}
    bundles = engine_bundles(t)
    assert bundles == [{"GPU": 1.0, "target_worker": 1, "CPU": 1.0}] + [{"GPU": 1.0, "target_worker": 1}] * 3

    @ray.remote
    class Probe:
        def seen(self):
            pg = ray.util.get_current_placement_group()
            return None if pg is None else (pg.id.hex(), pg.bundle_specs)

    ray.init(address="local", num_cpus=2, num_gpus=4, resources={"target_worker": 4}, include_dashboard=False)
    try:
        pg = engine_placement_group(t, name="replica-0")
        opts = engine_actor_options(t, pg)
        assert opts["num_gpus"] == 0 and "resources" not in opts
        opts = {k: v for k, v in opts.items() if k != "runtime_env"}  # the probe runs in this environment
        probe = Probe.options(**opts).remote()
        pg_id, specs = ray.get(probe.seen.remote(), timeout=60)
        assert pg_id == pg.id.hex() and [b.get("GPU") for b in specs] == [1.0] * 4
        assert all(b.get("target_worker") == 1 for b in specs)
        ray.kill(probe)
        # a restarted feature service asks again under the same name: the old group is removed, not left holding
        # the GPUs while the new one waits
        again = engine_placement_group(t, name="replica-0")
        assert ray.get(again.ready(), timeout=60) and again.id != pg.id
        states = {g["placement_group_id"]: g["state"] for g in ray.util.placement_group_table().values()}
        assert states[pg.id.hex()] == "REMOVED" and states[again.id.hex()] == "CREATED"
        assert engine_placement_group({**t, "vllm_executor": "mp"}, "replica-1") is None
        remove_placement_group(again)
    finally:
        ray.shutdown()


def test_layer_ids_map_to_vllm_aux_ids_with_the_lm_head_input_last():
    L, D = 4, 8
    assert FINAL_AUX_ID == -1
    assert aux_layer_ids([2, -1], L) == [2, -1] and aux_layer_ids([0, L, 1], L) == [0, 1, -1]
    assert aux_layer_ids([3, 1, 3], L) == [1, 3, -1]  # ascending, as vLLM's model appends them, the final last
    with pytest.raises(ValueError, match="target layer 5 out of range"):
        aux_layer_ids([5], L)
    # DeepSeek-V4 in vLLM taps decoder-layer outputs only: no embeddings (0)
    assert first_aux_id({"num_hidden_layers": 4}) == 0 and first_aux_id({"hc_mult": 4}) == 1
    assert aux_layer_ids([1, L], L, first=1) == [1, -1]
    with pytest.raises(ValueError, match="does not capture the embeddings") as e:
        aux_layer_ids([0, 2], L, first=1)
    assert "\n" not in str(e.value)
    states_TKD = torch.randn(6, 3, D)  # aux ids [0, 2, FINAL]: the engine's LM-head input comes last
    ctx_TF, final_TD = layer_features(states_TKD, [0, 2, -1], [2, -1, L, 0], L)
    assert torch.equal(final_TD, states_TKD[:, 2])
    assert torch.equal(ctx_TF, torch.cat([states_TKD[:, 1], states_TKD[:, 2], states_TKD[:, 2], states_TKD[:, 0]], -1))


def _make_vllm_env():
    import importlib.util

    from launch_helpers import REPO

    spec = importlib.util.spec_from_file_location("make_vllm_env", REPO / "launch" / "make_vllm_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_capture_plugin_wheel_holds_one_module_and_its_entry_point(tmp_path):
    """What launch/make_vllm_env.py installs into vLLM's environment: pip's RECORD lists every file with its hash,
    vLLM finds the `vllm.general_plugins` entry point, and the module does nothing outside our engines."""
    import base64
    import hashlib
    import zipfile

    mod = _make_vllm_env()
    wheel = mod.plugin_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = f"{mod.PLUGIN}-{mod.PLUGIN_VERSION}.dist-info"
        meta = ("METADATA", "WHEEL", "entry_points.txt", "RECORD")
        assert names == {f"{mod.PLUGIN}.py", *(f"{info}/{n}" for n in meta)}
        entry = z.read(f"{info}/entry_points.txt").decode()
        assert "[vllm.general_plugins]\ndspark_capture = dspark_vllm_plugin:register" in entry
        for line in z.read(f"{info}/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
        source = z.read(f"{mod.PLUGIN}.py").decode()
    namespace: dict = {}
    exec(compile(source, "dspark_vllm_plugin.py", "exec"), namespace)
    os.environ.pop("VLLM_DSPARK_CAPTURE_ARCH", None)
    namespace["register"]()  # outside our engines: imports nothing (no vllm here), registers nothing


def test_the_triton_interpreter_wheel_is_a_module_and_its_pth_and_is_inert_unless_asked(tmp_path):
    """The CPU build's stand-in (docs/vllm-serving.md): the wheel holds the module and the .pth that imports it at
    interpreter start; without DSPARK_TRITON_INTERPRETER=1 the module imports nothing and sets nothing. (What it does
    when asked, vLLM's HAS_TRITON turning true, is checked in the vLLM environment: make_vllm_env.py after
    installing, and tests/test_vllm_contract.py's vllm-marked test.)"""
    import zipfile

    mod = _make_vllm_env()
    wheel = mod.interpreter_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        info = f"{mod.INTERPRETER}-{mod.INTERPRETER_VERSION}.dist-info"
        assert set(z.namelist()) == {f"{mod.INTERPRETER}.py", f"{mod.INTERPRETER}.pth",
                                     *(f"{info}/{n}" for n in ("METADATA", "WHEEL", "RECORD"))}
        assert z.read(f"{mod.INTERPRETER}.pth").decode() == f"import {mod.INTERPRETER}\n"
        source = z.read(f"{mod.INTERPRETER}.py").decode()
    code = (f"import sys, os; exec(compile({source!r}, 'm.py', 'exec'), {{}}); "
            "print('triton' in sys.modules, os.environ.get('TRITON_INTERPRET'))")
    env = {k: v for k, v in os.environ.items() if k not in (mod.INTERPRETER_FLAG, "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None"]


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON}")
def test_the_stand_in_turns_vllms_triton_gate_on_only_when_asked():
    """In the vLLM environment make_vllm_env.py made: off, Triton has no "cpu" backend and vLLM disables Triton (the
    V1 runner, as installed); on, vLLM's HAS_TRITON is true (Model Runner V2 can start) and kernels are interpreted."""
    mod = _make_vllm_env()
    code = ("import os, triton.backends, vllm.triton_utils.importing as i; "
            "print('cpu' in triton.backends.backends, i.HAS_TRITON, os.environ.get('TRITON_INTERPRET'))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    for flag, want in (("0", ["False", "False", "None"]), ("1", ["True", "True", "1"])):
        res = subprocess.run([str(VLLM_PYTHON), "-c", code], env={**env, mod.INTERPRETER_FLAG: flag},
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.split()[-3:] == want, res.stdout


@pytest.mark.parametrize("transport", ["shm", "file"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_request_s_states_cross_the_hand_off_exactly_once(tmp_path, transport, dtype):
    path = str(tmp_path / f"req-{transport}.safetensors")
    open(path + ".lock", "w").close()  # vLLM's connector creates the lock before the path reaches the reader
    states_TKD, ids_T = torch.randn(7, 3, 5).to(dtype), torch.arange(7) * 11
    write_states(path, transport, states_TKD, ids_T)
    got_states, got_ids = read_states(path, transport)
    assert torch.equal(got_states, states_TKD) and torch.equal(got_ids, ids_T)
    assert not os.listdir(tmp_path)  # file, lock and shared-memory segment are gone
    assert not any(n.startswith("dspark_hs_") for n in os.listdir("/dev/shm"))


def test_the_feature_batch_is_built_on_our_side_from_plain_bytes():
    samples = [TokenizedSample(3, np.array([5, 6, 7]), np.array([0, 1, 1], bool)),
               TokenizedSample(9, np.array([8, 9]), np.array([1, 1], bool))]
    ctx_TF, final_TD = torch.randn(5, 8).bfloat16(), torch.randn(5, 4).bfloat16()
    raw = {"dtype": "bfloat16", "num_tokens": 5, "ctx_width": 8, "hidden": 4,
           "ctx": ctx_TF.view(torch.uint8).numpy().tobytes(), "final": final_TD.view(torch.uint8).numpy().tobytes()}
    assert all(type(v) in (int, str, bytes) for v in raw.values())  # nothing version-bound crosses
    fb = feature_batch(11, samples, raw, ctx_is_final=False)
    assert fb.batch_index == 11 and fb.sample_ids == (3, 9) and fb.seq_start_S1.tolist() == [0, 3, 5]
    assert torch.equal(fb.ctx_feats_TF, ctx_TF) and torch.equal(fb.final_hidden_TD, final_TD)
    assert fb.input_ids_T.tolist() == [5, 6, 7, 8, 9] and fb.loss_mask_T.tolist() == [0, 1, 1, 1, 1]
    with pytest.raises(RuntimeError, match="returned 5 token states for 4 tokens"):
        feature_batch(11, samples[:1] + [TokenizedSample(9, np.array([8]), np.array([1], bool))], raw, False)


def test_the_single_process_trainer_refuses_the_vllm_backend_in_one_line(tmp_path):
    from launch_helpers import run_launch

    res = run_launch(["--single-process", "--run-dir", str(tmp_path / "run"), "--max-steps", "1",
                      "target.backend=vllm"], timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "target.backend=vllm needs the Ray pipeline" in res.stderr and "drop --single-process" in res.stderr


def test_cluster_check_counts_a_vllm_replica_s_gpus_and_lets_vllm_s_ray_executor_span_nodes():
    from pipeline.errors import InputError
    from workers.driver import check_cluster_fits

    over = ["target.backend=vllm", "target.num_workers=1", "target.tp_size=16", "target.gpus_per_worker=1",
            "target.cpus_per_worker=8", "cluster.num_trainers=8", "cluster.use_gpu=true"]
    small = {"CPU": 64.0, "GPU": 8.0}
    check_cluster_fits(load_config(None, [*over, "target.vllm_executor=ray"]), [small] * 3)  # 16 + 8 GPUs
    with pytest.raises(InputError, match=r"^the run needs 24 GPUs"):
        check_cluster_fits(load_config(None, [*over, "target.vllm_executor=ray"]), [small] * 2)
    with pytest.raises(InputError, match=r"needs 16 GPUs on one node \(target.tp_size=16 x target.pp_size=1 x "
                                         r"target.gpus_per_worker=1\) but the largest node has 8$"):
        check_cluster_fits(load_config(None, [*over, "target.vllm_executor=mp"]), [small] * 3)
    # tp=2 on the mp executor: both ranks are one engine's processes on one node
    mp = ["target.backend=vllm", "target.tp_size=2", "target.gpus_per_worker=1", "target.vllm_executor=mp"]
    check_cluster_fits(load_config(None, mp), [{"CPU": 8.0, "GPU": 2.0}])
    with pytest.raises(InputError, match=r"^a target group needs 2 GPUs on one node \(target.tp_size=2 x "
                                         r"target.pp_size=1 x target.gpus_per_worker=1\) but the largest node has 1$"):
        check_cluster_fits(load_config(None, mp), [{"CPU": 8.0, "GPU": 1.0}] * 2)
    with pytest.raises(InputError, match=r"^the run needs 2 GPUs \(target.num_workers=1 x target.tp_size=2 x "
                                         r"target.pp_size=1 x target.gpus_per_worker=1, plus 0 for 2 trainer"):
        check_cluster_fits(load_config(None, mp), [{"CPU": 8.0, "GPU": 1.0}])
    with pytest.raises(ValueError, match="gpus_per_worker must be 1 with target.vllm_executor=ray"):
        load_config(None, ["target.backend=vllm", "target.vllm_executor=ray", "target.gpus_per_worker=0.5"])


def test_what_a_killed_engine_left_behind_is_removed_by_the_next_one():
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from workers.frozen_target.vllm_engine.transfer import STORAGE_PREFIX, remove_leftovers, storage_dir

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    mine = storage_dir()  # this (live) process's
    gone = Path(tempfile.mkdtemp(prefix=f"{STORAGE_PREFIX}{dead.pid}-"))
    for d in (Path(mine), gone):
        path = str(d / "0-abc.safetensors")
        open(path + ".lock", "w").close()
        write_states(path, "shm", torch.ones(2, 1, 3), torch.arange(2))
    try:
        assert remove_leftovers() >= 2  # the dead engine's directory and its segment
        assert not gone.exists() and Path(mine).is_dir()
        states, _ = read_states(str(Path(mine) / "0-abc.safetensors"), "shm")  # the live one's is untouched
        assert torch.equal(states, torch.ones(2, 1, 3))
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def test_embeddings_are_read_in_both_checkpoint_layouts_and_a_quantized_head_is_refused(tmp_path):
    """The trainers' frozen embedding and LM head, read on our side: Hugging Face names, DeepSeek's own layout
    (`embed.weight`, `head.weight`: V3/V4 as published, what vLLM loads), tied weights; an FP8 head is one line."""
    from safetensors.torch import save_file

    from workers.frozen_target.vllm_worker import checkpoint_embeddings

    e, h = torch.randn(10, 4), torch.randn(10, 4)
    for name, tensors in {"hf": {"model.embed_tokens.weight": e, "lm_head.weight": h},
                          "deepseek": {"embed.weight": e.bfloat16(), "head.weight": h.bfloat16()},
                          "tied": {"model.embed_tokens.weight": e}}.items():
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        got_e, got_h = checkpoint_embeddings(tmp_path / name, "float32")
        tol = 1e-2 if name == "deepseek" else 0
        torch.testing.assert_close(got_e, e, rtol=tol, atol=tol)
        torch.testing.assert_close(got_h, e if name == "tied" else h, rtol=tol, atol=tol)
    (tmp_path / "fp8").mkdir()
    save_file({"embed.weight": e, "head.weight": h.to(torch.float8_e4m3fn)},
              str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="head.weight is stored as torch.float8_e4m3fn") as err:
        checkpoint_embeddings(tmp_path / "fp8", "float32")
    assert "\n" not in str(err.value)


def test_placement_group_names_survive_an_actor_restart_and_differ_elsewhere():
    """A restarted feature service (same actor id) asks for its groups under the same names, so the stale ones are
    removed (workers/frozen_target/placement.py); a driver or another actor gets names of its own."""
    import time

    import ray

    from workers.frozen_target.placement import group_name

    @ray.remote(max_restarts=1)
    class Owner:
        def name(self):
            return group_name("vllm-target", 0)

        def die(self):
            import os

            os._exit(1)

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        owner = Owner.remote()
        before = ray.get(owner.name.remote(), timeout=60)
        owner.die.remote()
        for _ in range(60):  # the restarted actor (same id) answers again
            try:
                after = ray.get(owner.name.remote(), timeout=10)
                break
            except ray.exceptions.RayActorError:
                time.sleep(1)
        assert after == before and before.endswith("-0") and before.startswith("dspark-vllm-target-")
        assert ray.get(Owner.remote().name.remote(), timeout=60) != before  # another owner
        assert group_name("vllm-target", 0) != group_name("vllm-target", 0)  # outside an actor: unique per call
    finally:
        ray.shutdown()
