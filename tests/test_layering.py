"""The floor plan, checked: every import of every .py file (module level and inside functions) points down.

Floors, bottom to top (docs/architecture.md): draft_model < pipeline < serving < workers < evaluation, and above
them the entry points bench/, launch/ and tests/. An import may reach its own package or a lower floor, and:
- draft_model/ is pure PyTorch: no ray, deepspeed or torch.distributed, no project package but itself;
- evaluation/ may use the target (workers.frozen_target) but not the trainers (workers.trainer) nor the driver: it reads
  exports through pipeline.export;
- bench/ does not import tests/; nothing imports launch/ (tests run its scripts as subprocesses);
- vllm is imported only in workers/frozen_target/vllm_engine/ and bench/vllm_side_*.py, the code that runs inside
  the vLLM environment (docs/vllm-target.md), and that code imports only the standard library, numpy, torch,
  safetensors, vllm and itself: nothing on the trainer side imports vLLM, and the engine loads where our
  dependencies are absent;
- no import cycle between the top-level packages, and none between modules (a circle hidden in a function body
  is still a circle).
The checker is plain `ast`; test_the_checker_flags_bad_imports proves it can fail.

Run: python -m pytest tests/test_layering.py -q
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = ["draft_model", "pipeline", "serving", "workers", "evaluation"]  # bottom to top
ENTRY_POINTS = ["bench", "launch", "tests"]  # folders of scripts and tests, above every floor
PURE_TORCH_FORBIDDEN = ("ray", "deepspeed", "torch.distributed")
VLLM_SIDE = "workers.frozen_target.vllm_engine"  # runs in the vLLM environment
VLLM_SIDE_ALLOWED = ("numpy", "torch", "safetensors", "vllm", VLLM_SIDE)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_local_module(root: Path, name: str) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file, function-local ones included. `from a import b` yields
    a.b when that is a module of this tree or a forbidden one (`from torch import distributed`), else a; relative
    imports are resolved against the file's package."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{module}.{alias.name}" if module else alias.name
                named = _is_local_module(root, full) or any(_within(full, f) for f in PURE_TORCH_FORBIDDEN)
                yield node.lineno, full if named else module


def _top(module: str) -> str:
    return module.split(".")[0]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def python_files(root: Path) -> list[Path]:
    skip = {".git", "shared", "build", "dist", "runs"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def violations(root: Path) -> list[str]:
    """Every broken rule of the module docstring, one line each ('file:line: why')."""
    local = set(FLOORS) | set(ENTRY_POINTS)
    found, package_edges, module_edges = [], set(), {}
    for path in python_files(root):
        rel = path.relative_to(root)
        src = rel.parts[0] if len(rel.parts) > 1 else ""
        me = _module_name(path, root)
        for line, target in sorted(set(imports(path, root))):  # `from a import b, c` names a twice
            top = _top(target)
            where = f"{rel}:{line}: {src or rel} imports {target}"
            if src == "draft_model":
                if any(_within(target, f) for f in PURE_TORCH_FORBIDDEN):
                    found.append(f"{where}: draft_model/ is pure PyTorch")
                elif top in local and top != "draft_model":
                    found.append(f"{where}: draft_model/ imports no other project package")
            # bench/vllm_side_*.py: a bench's half that runs in the vLLM environment (bench/serve_vllm.py starts it)
            vllm_side = _within(me, VLLM_SIDE) or (src == "bench" and path.stem.startswith("vllm_side_"))
            if top == "vllm" and not vllm_side:
                found.append(f"{where}: only {VLLM_SIDE} imports vllm (it runs in the vLLM environment)")
            if vllm_side and not (top in sys.stdlib_module_names
                                  or any(_within(target, a) for a in VLLM_SIDE_ALLOWED)):
                found.append(f"{where}: {VLLM_SIDE} imports only the stdlib, {', '.join(VLLM_SIDE_ALLOWED[:-1])} "
                             "and itself (it runs in the vLLM environment)")
            if top == "launch":
                found.append(f"{where}: nothing imports launch/ (run its scripts instead)")
            tests_helper = (root / "tests" / f"{top}.py").is_file() and not (root / "bench" / f"{top}.py").is_file()
            if src == "bench" and (top == "tests" or tests_helper):  # by name too: a helper put on sys.path
                found.append(f"{where}: bench/ does not import tests/")
            if src == "evaluation" and top == "workers" and not _within(target, "workers.frozen_target"):
                found.append(f"{where}: evaluation/ uses the target (workers.frozen_target), "
                             "not the trainers or the driver")
            if src in FLOORS and top in FLOORS and FLOORS.index(top) > FLOORS.index(src):
                found.append(f"{where}: an arrow up ({src} is below {top})")
            if src in FLOORS and top in ENTRY_POINTS:
                found.append(f"{where}: a package imports an entry point ({top}/)")
            if src in FLOORS and top in FLOORS and top != src:
                package_edges.add((src, top))
            if src in FLOORS and top in FLOORS and target != me:
                module_edges.setdefault(me, set()).add(target)
    found += [f"import cycle between packages: {' -> '.join(c)}" for c in _cycles(package_edges)]
    module_pairs = {(a, b) for a, bs in module_edges.items() for b in bs}
    found += [f"import cycle between modules: {' -> '.join(c)}" for c in _cycles(module_pairs)]
    return found


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Cycles as closed paths: one through each node that is not on a cycle reported already."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    cycles, reported = [], set()
    for start in sorted(graph):
        if start in reported:
            continue
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycles.append([*path, start])
                    reported.update(path)
                    stack.clear()
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_the_repository_keeps_its_floor_plan():
    assert violations(REPO) == []


def test_the_checker_flags_bad_imports(tmp_path):
    """A synthetic tree with one of each mistake, several hidden in function bodies: every one is reported."""
    files = {
        "draft_model/__init__.py": "",
        "draft_model/model.py": "def f():\n    import torch.distributed as dist\n",
        "draft_model/registry.py": "from pipeline.config import RunConfig\n",
        "draft_model/a.py": "def f():\n    from draft_model import b\n",
        "draft_model/b.py": "from . import a\n",
        "pipeline/__init__.py": "",
        "pipeline/config.py": "def f():\n    from workers.driver import run\n",
        "workers/__init__.py": "",
        "workers/driver.py": "import pipeline.config\n",
        "serving/__init__.py": "",
        "serving/calibration.py": "from evaluation import metrics\n",
        "evaluation/__init__.py": "",
        "evaluation/metrics.py": "",
        "evaluation/drafters.py": "def load():\n    from workers.trainer.checkpoint import load\n",
        "workers/trainer/__init__.py": "",
        "workers/trainer/checkpoint.py": "def f():\n    from vllm import LLM\n",
        "workers/frozen_target/__init__.py": "",
        "workers/frozen_target/vllm_engine/__init__.py": "",
        "workers/frozen_target/vllm_engine/engine.py": "import json\nimport vllm\nfrom pipeline import config\n",
        "bench/faults.py": "import tests.launch_helpers\n",
        "bench/pipeline.py": "from dist_helpers import free_port\n",
        "tests/dist_helpers.py": "",
        "tests/launch_helpers.py": "",
        "tests/test_x.py": "from launch.train import main\n",
        "launch/train.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = "\n".join(violations(tmp_path))
    for expected in ("draft_model/model.py:2: draft_model imports torch.distributed: draft_model/ is pure PyTorch",
                     "draft_model/registry.py:1: draft_model imports pipeline.config: draft_model/ imports no other",
                     "pipeline/config.py:2: pipeline imports workers.driver: an arrow up (pipeline is below workers)",
                     "serving/calibration.py:1: serving imports evaluation.metrics: an arrow up",
                     "evaluation/drafters.py:2: evaluation imports workers.trainer.checkpoint: evaluation/ uses",
                     "bench/faults.py:1: bench imports tests.launch_helpers: bench/ does not import tests/",
                     "bench/pipeline.py:1: bench imports dist_helpers: bench/ does not import tests/",
                     "tests/test_x.py:1: tests imports launch.train: nothing imports launch/",
                     "workers/trainer/checkpoint.py:2: workers imports vllm: only workers.frozen_target.vllm_engine",
                     "vllm_engine/engine.py:3: workers imports pipeline.config: workers.frozen_target.vllm_engine "
                     "imports only the stdlib",
                     "import cycle between packages: pipeline -> workers -> pipeline",
                     "import cycle between modules: draft_model.a -> draft_model.b -> draft_model.a"):
        assert expected in found, f"not flagged: {expected}\n{found}"
