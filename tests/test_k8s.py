"""Offline validation of the Kubernetes manifests in k8s/.

Run:  python -m pytest tests/test_k8s.py -q          (add `-m slow` for the submitter-script test on a local Ray head)

KubeRay kinds (RayJob, RayCluster) are checked against the operator's CRD schemas vendored in tests/schemas/kuberay/
(the `v1` openAPIV3Schema) twice: with `jsonschema` for types and required fields, and with a key walker
(tests/k8s_schema.py), because a JSON-schema validator accepts keys the schema does not list while the API server
prunes them: a misspelled optional field (`shutdownAfterJobFinish`) would silently fall back to its default. The
CRD's CEL rules (`x-kubernetes-validations`) are not evaluated; outside the pod templates they guard only
deletionStrategy, managedBy and gcsFaultToleranceOptions, which the manifests do not set. Plain kinds (Job,
PersistentVolumeClaim, ConfigMap) and the RayJob's pod templates go through `kubernetes-validate` in strict mode
(unknown keys are errors), plus a small structural check that always runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from k8s_schema import SCHEMA_DIR, check_crd_document, read_crd_schema, schema_key_problems
from launch_helpers import RAY_CLI

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "k8s"
# Validated against the oldest Kubernetes the manifests target (the Job's `batch.kubernetes.io/controller-uid`
# label is 1.27+) and the newest one the installed kubernetes-validate ships.
OLDEST_K8S = "1.27"
PVC_MOUNT = "/checkpoints"
CHECKPOINT_CLAIM, INPUT_CLAIM = "dspark-checkpoints", "dspark-inputs"
INPUT_MOUNTS = {"/models": "models", "/data": "data"}  # mountPath -> subPath on the inputs claim
LAUNCH_SCRIPT = "launch/train_v4_draft.py"
GPU = "nvidia.com/gpu"


def _load_documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


DOCS = _load_documents()


def _only(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in DOCS if doc["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind} in k8s/, found {len(found)}"
    return found[0]


def _claim(name: str) -> dict[str, Any]:
    (pvc,) = [doc for _, doc in DOCS if doc["kind"] == "PersistentVolumeClaim" and doc["metadata"]["name"] == name]
    return pvc


def _crd_schema(kind: str) -> dict[str, Any]:
    assert SCHEMA_DIR.is_dir(), f"the vendored KubeRay CRD schemas are missing from {SCHEMA_DIR}"
    return read_crd_schema(kind)


def _check(doc: dict[str, Any]) -> list[str]:
    _crd_schema(doc["kind"])
    return check_crd_document(doc)


# ---- schema validation ----------------------------------------------------------------------------------------


def test_k8s_folder_has_the_expected_documents() -> None:
    kinds = sorted(doc["kind"] for _, doc in DOCS)
    assert kinds == ["Job", "PersistentVolumeClaim", "PersistentVolumeClaim", "RayCluster", "RayJob"]
    assert all(doc["apiVersion"] == "ray.io/v1" for _, doc in DOCS if doc["kind"].startswith("Ray"))


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_kuberay_documents_match_crd_schema(kind: str) -> None:
    assert _check(_only(kind)) == []


def test_key_walker_rejects_misspelled_fields() -> None:
    rayjob = copy.deepcopy(_only("RayJob"))
    spec = rayjob["spec"]
    spec["shutdownAfterJobFinish"] = spec.pop("shutdownAfterJobFinishes")
    trainer_container = spec["rayClusterSpec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]
    trainer_container["volumeMount"] = trainer_container.pop("volumeMounts")
    # A plain JSON-schema validator is blind to both typos: that is why the walker exists.
    jsonschema.Draft7Validator(_crd_schema("RayJob")).validate(rayjob)
    assert sorted(_check(rayjob)) == [
        "spec.rayClusterSpec.workerGroupSpecs[1].template.spec.containers[0].volumeMount: not in the RayJob schema",
        "spec.shutdownAfterJobFinish: not in the RayJob schema",
    ]


def test_crd_validation_rejects_wrong_types_and_metadata_typos() -> None:
    rayjob = copy.deepcopy(_only("RayJob"))
    rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    rayjob["metadata"]["label"] = {"a": "b"}
    problems = _check(rayjob)
    assert any(p.startswith("spec.rayClusterSpec.workerGroupSpecs.0.replicas:") for p in problems), problems
    assert "metadata.label: not an ObjectMeta field" in problems


def test_key_walker_reports_preserved_fields_as_unchecked() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                               "b": {"type": "object", "additionalProperties": {"type": "string"}}}}
    assert schema_key_problems({"a": {"anything": 1}, "b": {"k": "v"}, "c": 1}, schema) == (["c"], ["a"])


def _kubernetes_validate():
    return pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate not installed (dev extra)")


def _plain_documents() -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if not doc["kind"].startswith("Ray")]


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    spec = _only("RayJob")["spec"]["rayClusterSpec"]
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, group["template"]) for name, group in groups]


@pytest.mark.parametrize("version", [OLDEST_K8S, "latest"])
def test_plain_kinds_and_pod_templates_pass_kubernetes_validate(version: str) -> None:
    kv = _kubernetes_validate()
    version = kv.latest_version() if version == "latest" else version
    for doc in _plain_documents():
        kv.validate(doc, version, strict=True)
    for name, template in _pod_templates():
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template},
                    version, strict=True)


def test_kubernetes_validate_rejects_a_misspelled_job_field() -> None:
    kv = _kubernetes_validate()
    job = copy.deepcopy(_only("Job"))
    job["spec"]["backoffLimits"] = job["spec"].pop("backoffLimit")
    with pytest.raises(kv.ValidationError, match="backoffLimits"):
        kv.validate(job, OLDEST_K8S, strict=True)


def test_plain_kinds_structure() -> None:
    # Runs without kubernetes-validate: the few fields the API server requires and we rely on.
    for doc in _plain_documents():
        assert doc["metadata"]["name"], doc
    for name in (CHECKPOINT_CLAIM, INPUT_CLAIM):
        pvc = _claim(name)
        assert pvc["apiVersion"] == "v1"
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], f"{name}: pods on several nodes mount it"
        assert re.fullmatch(r"\d+(Gi|Ti)", pvc["spec"]["resources"]["requests"]["storage"])
    job = _only("Job")
    assert job["apiVersion"] == "batch/v1"
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    assert isinstance(job["spec"]["backoffLimit"], int) and job["spec"]["backoffLimit"] >= 1
    for container in job["spec"]["template"]["spec"]["containers"]:
        assert container["name"] and container["image"]


# ---- what the manifests must say ------------------------------------------------------------------------------


def test_rayjob_entrypoint_runs_the_launch_script_with_a_run_dir_on_the_pvc() -> None:
    argv = shlex.split(_only("RayJob")["spec"]["entrypoint"])
    assert argv[:2] == ["python", LAUNCH_SCRIPT]
    config = argv[argv.index("--config") + 1]
    assert config == "launch/configs/v4-flash.yaml"
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    assert run_dir.parent == Path(PVC_MOUNT) and run_dir.name, "one run per directory directly under the mount"
    runtime_env = yaml.safe_load(_only("RayJob")["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/app", "the entrypoint's relative paths are relative to the image's /app"


def test_rayjob_cleans_up_and_retries() -> None:
    spec = _only("RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] > 0
    assert spec["backoffLimit"] >= 1, "a retry resumes from `latest`, so retrying is cheap"
    assert spec["activeDeadlineSeconds"] >= 24 * 3600


def _claim_volume(pod: dict[str, Any], claim: str) -> dict[str, Any]:
    volumes = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
    assert len(volumes) == 1, f"expected one volume for claim {claim}, found {len(volumes)}"
    return volumes[0]


def test_every_pod_mounts_the_checkpoint_and_input_claims() -> None:
    for name, template in _pod_templates():
        pod = template["spec"]
        checkpoints = _claim_volume(pod, CHECKPOINT_CLAIM)
        inputs = _claim_volume(pod, INPUT_CLAIM)
        assert inputs["persistentVolumeClaim"]["readOnly"] is True, f"{name}: training never writes its inputs"
        for container in pod["containers"]:
            where = f"{name}/{container['name']}"
            mounts = [m for m in container["volumeMounts"] if m["name"] == checkpoints["name"]]
            assert [m["mountPath"] for m in mounts] == [PVC_MOUNT], f"{where}: checkpoints not at {PVC_MOUNT}"
            assert not mounts[0].get("readOnly", False) and "subPath" not in mounts[0]
            mounts = [m for m in container["volumeMounts"] if m["name"] == inputs["name"]]
            assert {m["mountPath"]: m["subPath"] for m in mounts} == INPUT_MOUNTS, where
            assert all(m["readOnly"] for m in mounts), where


def _ray_custom_resources(group: dict[str, Any]) -> dict[str, float]:
    # KubeRay's format: a JSON object, itself quoted as a JSON string: '"{\"trainer\": 8}"'.
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def _gpus(template: dict[str, Any]) -> int:
    total = 0
    for container in template["spec"]["containers"]:
        res = container.get("resources", {})
        limit = res.get("limits", {}).get(GPU)
        assert res.get("requests", {}).get(GPU, limit) == limit, "GPU requests must equal limits"
        total += int(limit or 0)
    return total


def test_gpu_groups_and_ray_placement_resources() -> None:
    spec = _only("RayJob")["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]
    assert _gpus(head["template"]) == 0 and head["rayStartParams"]["num-cpus"] == "0", "head does no GPU work"
    assert _ray_custom_resources(head) == {}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"target-workers", "trainers"}
    for group in groups.values():
        assert _gpus(group["template"]) > 0
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # One unit per GPU: a vLLM engine rank takes one (resources_per_worker is per rank), as a trainer rank does.
    target_gpus = _gpus(groups["target-workers"]["template"])
    assert _ray_custom_resources(groups["target-workers"]) == {"target_worker": target_gpus}
    assert _ray_custom_resources(groups["trainers"]) == {"trainer": _gpus(groups["trainers"]["template"])}


def test_images_and_ray_version_agree_with_the_project() -> None:
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray_pin,) = [p for p in pins if p.startswith("ray[")]
    spec = _only("RayJob")["spec"]["rayClusterSpec"]
    assert ray_pin.endswith("==" + spec["rayVersion"])
    images = {c["image"] for _, t in _pod_templates() for c in t["spec"]["containers"]}
    images |= {c["image"] for c in _only("Job")["spec"]["template"]["spec"]["containers"]}
    assert images == {_readme_image()}, "every manifest names the image k8s/README.md builds"


def _readme_image() -> str:
    """The image k8s/README.md's build command tags: `IMAGE=<name>` then `docker build -f k8s/Dockerfile -t $IMAGE .`"""
    text = (K8S_DIR / "README.md").read_text()
    (image,) = re.findall(r"^IMAGE=(\S+)$", text, re.M)
    (dockerfile,) = re.findall(r"^docker build -f (\S+) -t \$IMAGE \.", text, re.M)
    assert (REPO / dockerfile).is_file() and dockerfile == "k8s/Dockerfile"
    return image


def _dockerfile() -> list[tuple[str, str]]:
    """k8s/Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    lines, joined = [], ""
    for raw in (K8S_DIR / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") and not joined:
            continue
        joined += raw.rstrip().removesuffix("\\") + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            if joined.strip():
                word, _, rest = joined.strip().partition(" ")
                lines.append((word, " ".join(rest.split())))
            joined = ""
    return lines


def test_dockerfile_pins_a_cuda_torch_and_its_nccl_that_nothing_replaces() -> None:
    steps = _dockerfile()
    known = {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "CMD"}
    assert {w for w, _ in steps} <= known, [w for w, _ in steps if w not in known]
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG")
    ci_torch = re.search(r"pip install torch==(\S+)", (REPO / ".ci" / "run").read_text()).group(1)
    assert args["TORCH_VERSION"] == ci_torch == "2.13.0"  # the project's pin, as CI installs it
    cuda = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d\d)(\d)", args["TORCH_INDEX"])
    assert cuda, args["TORCH_INDEX"]
    # the NCCL of that CUDA major, pinned to an exact version
    assert re.fullmatch(rf"nvidia-nccl-cu{cuda.group(1)}==\d+\.\d+\.\d+", args["NCCL_PIN"]), args["NCCL_PIN"]
    assert re.fullmatch(r"\$\{CUDA_BASE\}", steps[1][1]) and args["CUDA_BASE"].startswith("nvidia/cuda:")
    assert f"-{cuda.group(1)}.{cuda.group(2)}." in "-" + args["CUDA_BASE"].split(":")[1], args["CUDA_BASE"]
    runs = [a for w, a in steps if w == "RUN"]
    (torch_run,) = [i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r]
    assert '"${NCCL_PIN}"' in runs[torch_run] and '--index-url "${TORCH_INDEX}"' in runs[torch_run]
    (project_run,) = [i for i, r in enumerate(runs) if r.startswith("pip install -e /app")]
    assert torch_run < project_run
    # every pip call after torch's runs under the constraints file that holds torch and NCCL
    env_at = [i for i, (w, a) in enumerate(steps) if w == "ENV" and "PIP_CONSTRAINT=/etc/pip-constraints.txt" in a]
    assert env_at and env_at[0] < [i for i, (w, a) in enumerate(steps) if a.startswith("pip install -e")][0]
    assert "/etc/pip-constraints.txt" in runs[torch_run]
    # the last RUN asserts the versions, as .ci/run does for the CPU wheel
    check = runs[-1]
    assert check.startswith("python -c") and "assert v.split('+')[0] == '2.13.0'" in check
    assert "torch.version.cuda.startswith('13.0')" in check and "md.version(nccl_name) == nccl_version" in check
    # apt as hadolint wants it: update and install in one layer, no recommends, lists removed
    for r in runs:
        if "apt-get update" in r:
            assert "apt-get install -y --no-install-recommends" in r and "rm -rf /var/lib/apt/lists/*" in r


def test_dockerignore_keeps_runs_caches_and_carried_wheels_out() -> None:
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".git", "runs", ".cache", ".whl"} <= ignored, ignored


def test_standing_raycluster_has_the_rayjob_cluster_shape() -> None:
    assert _only("RayCluster")["spec"] == _only("RayJob")["spec"]["rayClusterSpec"]


def _entrypoint_config():
    """The RunConfig the launcher builds from the RayJob's entrypoint (its own argument parsing and validation): the
    entrypoint run with --print-config from the repository root (the job runs in /app, a copy of it)."""
    from launch_helpers import run_script

    from pipeline.config import config_from_dict

    argv = shlex.split(_only("RayJob")["spec"]["entrypoint"])
    assert argv[:2] == ["python", LAUNCH_SCRIPT]
    res = run_script(Path(LAUNCH_SCRIPT).name, [*argv[2:], "--print-config"], timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return config_from_dict(yaml.safe_load(res.stdout))


def _cpus(template: dict[str, Any]) -> float:
    # KubeRay advertises the container CPU limit as Ray's num-cpus.
    return sum(float(c["resources"]["limits"]["cpu"]) for c in template["spec"]["containers"])


def _under(path: str, template: dict[str, Any]) -> bool:
    mounts = [m["mountPath"] for c in template["spec"]["containers"] for m in c.get("volumeMounts", [])]
    return any(Path(path).is_relative_to(m) for m in mounts)


def test_cluster_shape_matches_the_launched_config() -> None:
    cfg = _entrypoint_config()
    assert cfg.checkpoint.run_dir == shlex.split(_only("RayJob")["spec"]["entrypoint"])[-1]
    spec = _only("RayJob")["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    target, trainers = groups["target-workers"], groups["trainers"]
    # The presets run the target on vLLM: num_workers replicas of tp x pp GPUs, whole pods each; custom resources
    # per engine rank (one per GPU), the engine actor's CPUs a pod at most.
    t = cfg.target
    assert t.backend == "vllm"
    assert target["replicas"] == t.num_workers * target_pods_per_replica(cfg, _gpus(target["template"]))
    per_pod = _gpus(target["template"]) / t.gpus_per_worker
    assert _ray_custom_resources(target) == {k: v * per_pod for k, v in t.resources_per_worker.items()}
    assert _cpus(target["template"]) >= t.cpus_per_worker
    # One trainer rank per GPU, each asking for its custom resources and CPUs.
    c = cfg.cluster
    assert c.use_gpu and trainers["replicas"] * _gpus(trainers["template"]) == c.num_trainers
    per_pod = _gpus(trainers["template"])
    assert _ray_custom_resources(trainers) == {k: v * per_pod for k, v in c.resources_per_trainer.items()}
    assert _cpus(trainers["template"]) >= c.cpus_per_trainer * per_pod
    # The inputs the config names are mounted where they are read: the driver (head) reads the tokenizer and the
    # data set, the target workers load the target.
    head = spec["headGroupSpec"]["template"]
    assert _under(t.path, head) and _under(t.path, target["template"]) and _under(cfg.data.source, head)


def target_pods_per_replica(cfg, gpus_per_pod: int) -> int:
    """Pods of gpus_per_pod GPUs one vLLM replica of the config takes: tp x pp x gpus_per_worker GPUs, whole pods;
    more than one only with vLLM's "ray" executor (its "mp" workers are processes of one node)."""
    t = cfg.target
    gpus = t.tp_size * t.pp_size * t.gpus_per_worker
    pods, rest = divmod(gpus, gpus_per_pod)
    if rest or not pods:
        raise ValueError(f"a replica's {gpus:g} GPUs do not fill whole {gpus_per_pod}-GPU pods")
    if pods > 1 and t.vllm_executor != "ray":
        raise ValueError(f"a replica spans {pods:g} pods: that needs target.vllm_executor=ray")
    return int(pods)


def _manifest_nodes(cfg, target_pods: int | None = None) -> list[dict[str, float]]:
    """The Ray nodes the RayJob's worker groups start (head: no CPUs, no GPUs), as ray.nodes() reports them;
    target_pods: that many target-worker pods instead of the manifest's replicas (another preset on the same pods)."""
    spec = _only("RayJob")["spec"]["rayClusterSpec"]
    nodes = [{"CPU": 0.0}]
    for group in spec["workerGroupSpecs"]:
        pods = group["replicas"] if target_pods is None or group["groupName"] != "target-workers" else target_pods
        node = {"CPU": _cpus(group["template"]), "GPU": float(_gpus(group["template"])),
                **_ray_custom_resources(group)}
        nodes += [dict(node) for _ in range(pods)]
    return nodes


def test_launcher_accepts_the_manifest_and_each_preset_on_pods_of_that_shape() -> None:
    from pipeline.config import load_config
    from pipeline.errors import InputError
    from workers.driver import check_cluster_fits

    cfg = _entrypoint_config()
    check_cluster_fits(cfg, _manifest_nodes(cfg))
    with pytest.raises(InputError, match="GPUs"):  # one target pod short
        check_cluster_fits(cfg, _manifest_nodes(cfg, target_pods=_only("RayJob")["spec"]["rayClusterSpec"]
                                                ["workerGroupSpecs"][0]["replicas"] - 1))
    gpus_per_pod = _gpus(_only("RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"])
    # v4-pro on the same 8-GPU pods (its 16 trainers on two trainer pods), one node a replica, and over two nodes
    # a replica with vLLM's tensor parallelism over Ray: twice the target pods
    for overrides, pods in (([], 4), (["target.tp_size=16", "target.vllm_executor=ray"], 8)):
        pro = load_config(REPO / "launch/configs/v4-pro.yaml", overrides)
        assert pro.target.num_workers * target_pods_per_replica(pro, gpus_per_pod) == pods
        nodes = _manifest_nodes(pro, target_pods=pods)
        nodes += [n for n in nodes if "trainer" in n]  # a second trainer pod
        check_cluster_fits(pro, nodes)
    with pytest.raises(ValueError, match="vllm_executor=ray"):
        target_pods_per_replica(load_config(REPO / "launch/configs/v4-pro.yaml", ["target.tp_size=16"]), gpus_per_pod)


def test_dockerfile_makes_the_vllm_environment_the_presets_name() -> None:
    from pipeline.config import load_config

    steps = _dockerfile()
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG")
    assert args["VLLM_PACKAGE"] == "vllm==0.32.0"  # vLLM's CUDA wheel, the version of the CPU build tested here
    runs = [a for w, a in steps if w == "RUN"]
    (at,) = [i for i, r in enumerate(runs) if "launch/make_vllm_env.py" in r]
    assert at > [i for i, r in enumerate(runs) if r.startswith("pip install -e /app")][0]
    make = runs[at]
    # our torch / NCCL constraints must not bind vLLM's own pins
    assert make.startswith("env -u PIP_CONSTRAINT python /app/launch/make_vllm_env.py")
    assert '--dir "${VLLM_ENV}"' in make and '--vllm-package "${VLLM_PACKAGE}"' in make
    python = f"{args['VLLM_ENV']}/bin/python"
    assert ("ENV", "DSPARK_VLLM_PYTHON=${VLLM_ENV}/bin/python") in steps
    for preset in ("v4-flash", "v4-pro"):
        t = load_config(REPO / f"launch/configs/{preset}.yaml").target
        assert (t.backend, t.vllm_python) == ("vllm", python), preset


# ---- the plain-Job submitter ----------------------------------------------------------------------------------


def _submit_container() -> dict[str, Any]:
    (container,) = _only("Job")["spec"]["template"]["spec"]["containers"]
    return container


def _submit_script() -> str:
    command = _submit_container()["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    return command[2]


def test_submit_job_targets_the_head_service_and_runs_the_launch_script() -> None:
    container = _submit_container()
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_HEAD_SVC"]["value"] == _only("RayCluster")["metadata"]["name"] + "-head-svc"
    assert env["JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/controller-uid']")
    script = _submit_script()
    assert 'ADDR="http://${RAY_HEAD_SVC}:8265"' in script
    submit = script[script.index("ray job submit"):]
    assert '--address "$ADDR"' in submit and "--working-dir /app" in submit
    runtime_env = json.loads(re.search(r"--runtime-env-json '([^']*)'", submit).group(1))
    assert runtime_env == {"env_vars": {"PYTHONUNBUFFERED": "1"}}
    assert f"-- python {LAUNCH_SCRIPT}" in submit
    assert '--run-dir "/checkpoints/${RUN_NAME}"' in submit


def test_submit_script_is_valid_bash_without_kubernetes_expansions() -> None:
    container = _submit_container()
    # Kubernetes rewrites $(NAME) in command/args before bash sees them; the script must only use ${NAME}.
    assert not any("$(" in part for part in container["command"] + container["args"])
    subprocess.run(["bash", "-n", "-c", _submit_script()], check=True)


# ---- the submitter script against a real (local) Ray head ------------------------------------------------------

_STUB_LAUNCHER = """\
import json, pathlib, sys
args = sys.argv[1:]
assert pathlib.Path(args[args.index("--config") + 1]).is_file(), "entrypoint must run inside the working dir"
run_dir = pathlib.Path(args[args.index("--run-dir") + 1])
run_dir.mkdir(parents=True, exist_ok=True)
with open(run_dir / "calls.jsonl", "a") as f:
    f.write(json.dumps(args) + "\\n")
print("STUB-RAN", json.dumps(args))
sys.exit(3 if "fail=1" in args else 0)
"""


def _free_ports(n: int) -> list[int]:
    # Ephemeral ports, outside Ray's default worker port range (10002-19999).
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_submit_script_submits_once_and_reports_failures(tmp_path: Path) -> None:
    app, ckpt = tmp_path / "app", tmp_path / "checkpoints"
    (app / "launch" / "configs").mkdir(parents=True)
    (app / LAUNCH_SCRIPT).write_text(_STUB_LAUNCHER)
    (app / "launch/configs/v4-flash.yaml").write_text("{}\n")
    dash, agent, client = _free_ports(3)
    script = _submit_script()
    for old, new in (("--working-dir /app", f"--working-dir {app}"), ('"/checkpoints/', f'"{ckpt}/'),
                     (":8265", f":{dash}")):
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    # A loopback-only head with its own ports, so it neither reaches out nor collides with other local clusters.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_HEAD_SVC": "127.0.0.1", "RUN_NAME": "run-a"}
    head = subprocess.Popen(
        [*RAY_CLI, "start", "--head", "--block", "--port=0", "--num-cpus=1", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}",
         f"--ray-client-server-port={client}", "--node-ip-address=127.0.0.1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def submit(job_uid: str, *overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", script, "dspark-submit", *overrides], env={**env, "JOB_UID": job_uid},
                              capture_output=True, text=True, timeout=180)

    try:
        deadline = time.monotonic() + 90
        while subprocess.run([*RAY_CLI, "job", "list", "--address", f"http://127.0.0.1:{dash}"], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, "local Ray head did not come up"
            time.sleep(1)
        calls = ckpt / "run-a" / "calls.jsonl"

        first = submit("uid-1", "train.lr=3e-4")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "STUB-RAN" in first.stdout
        (args,) = [json.loads(line) for line in calls.read_text().splitlines()]
        assert args == ["--config", "launch/configs/v4-flash.yaml", "--run-dir", str(ckpt / "run-a"), "train.lr=3e-4"]

        # A retried pod of the same Job follows the existing Ray job instead of starting a second run.
        retry = submit("uid-1", "train.lr=3e-4")
        assert retry.returncode == 0, retry.stdout + retry.stderr
        assert "already submitted" in retry.stdout and "STUB-RAN" in retry.stdout
        assert len(calls.read_text().splitlines()) == 1

        # A new Job (new uid) is a new submission on the same run dir; a failing run fails the pod.
        failed = submit("uid-2", "fail=1")
        assert failed.returncode != 0
        assert len(calls.read_text().splitlines()) == 2
        # ...and its retry reports the failure too, after following the logs.
        failed_retry = submit("uid-2", "fail=1")
        assert failed_retry.returncode == 1 and "FAILED" in failed_retry.stdout
        assert len(calls.read_text().splitlines()) == 2
    finally:
        head.terminate()  # `ray start --block` drains and stops the processes of its own node on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
