"""The code's layout, as docs/development.md states it, read from the source (``ast``: nothing imported):
data flows one way (``walk/`` imports nothing of ``train/`` or TRL); ``walk/`` is a core and a folder per
concern whose modules never import the core's loop, and the trainers use the walk through its executor and
options only; ``train/``'s folders are methods (a trainer) and model passes (a second model walked on the
policy's trie), a method imports the seam at ``train/``'s root and model passes, a model pass no method, the
seam no folder; no module of the package imports itself through a cycle (deferred and annotation-only
imports included); no library file is over 400 lines, and none switches the formatter off."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trl_dta"
# train/'s folders are of two kinds: a method (a trainer on a TRL trainer: the folder has a trainer.py) and a
# model pass (a second model walked on the policy's trie, trl_dta/train/model_pass.py: no trainer.py); the
# files at train/'s root are the seam
FOLDERS = sorted(p.name for p in (PACKAGE / "train").iterdir() if (p / "__init__.py").exists())
METHODS = tuple(f for f in FOLDERS if (PACKAGE / "train" / f / "trainer.py").exists())
MODEL_PASSES = tuple(f for f in FOLDERS if f not in METHODS)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules ``path`` imports (relative imports resolved; ``from x import y`` counts as ``x``, and as
    ``x.y`` where that is a module of the package)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            submodules = {f"{target}.{alias.name}" for alias in node.names} & set(MODULES)
            out.update(submodules or {target})  # (from a package import its modules: those modules)
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (annotations only: no import at run
    time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {m for m in imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def folder_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "train" and parts[2] in FOLDERS else None


def test_walk_knows_nothing_of_train_or_trl():
    for name, path in MODULES.items():
        if name.startswith("trl_dta.walk"):
            bad = {m for m in imports(path) if m.split(".")[0] == "trl" or m.startswith("trl_dta.train")}
            assert not bad, f"{name} imports {sorted(bad)}"


# walk/: its core at its root, a folder per concern around it (docs/development.md). The loop that runs a walk
# is the core's; the rooms serve it and never import it.
WALK_ROOMS = ("attention", "memory", "cost", "distributed", "adapter")
WALK_LOOP = {f"trl_dta.walk.{m}" for m in ("executor", "steps", "state", "forwards", "inputs")}
# What the trainers (train/, vllm/) may use of the walk: the executor and its options, what it refuses, the
# memory and cost options they expose, the model adapter's checks. Never how a call attends, the path's K/V,
# a walk's state or its steps: the trainer knows nothing of KV caches.
TRAINERS_MAY_USE = {
    "trl_dta.walk.executor", "trl_dta.walk.errors", "trl_dta.walk.heads", "trl_dta.walk.router",
    "trl_dta.walk.scoring", "trl_dta.walk.adapter.checks", "trl_dta.walk.adapter.determinism",
    "trl_dta.walk.adapter.model", "trl_dta.walk.adapter.preflight", "trl_dta.walk.cost.cost_model",
    "trl_dta.walk.cost.costs", "trl_dta.walk.distributed.deepspeed", "trl_dta.walk.distributed.sharding",
    "trl_dta.walk.memory.budgets", "trl_dta.walk.memory.memory_budget", "trl_dta.walk.memory.memory_model",
    "trl_dta.walk.memory.recovery",
}  # fmt: skip


def walk_room(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "walk" and parts[2] in WALK_ROOMS else None


def test_walk_is_a_core_and_rooms_that_never_import_the_loop():
    folders = {p.name for p in (PACKAGE / "walk").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WALK_ROOMS), "a new folder of walk/ is a room: name it here and in development.md"
    for name, path in MODULES.items():
        if walk_room(name) is not None:
            loop = _all_imports(path) & WALK_LOOP
            assert not loop, f"{name} (walk/{walk_room(name)}/) imports the walk's loop: {sorted(loop)}"


def test_the_trainers_use_the_walk_through_its_executor_and_options_only():
    for name, path in MODULES.items():
        if name.startswith(("trl_dta.train", "trl_dta.vllm")):
            used = {d for d in _all_imports(path) if d.startswith("trl_dta.walk.")}
            assert used <= TRAINERS_MAY_USE, f"{name} uses walk internals: {sorted(used - TRAINERS_MAY_USE)}"


def test_the_seam_imports_no_folder_a_method_no_other_method_and_a_model_pass_no_method():
    assert METHODS and MODEL_PASSES, f"train/'s folders: {FOLDERS}"
    for name, deps in GRAPH.items():
        if not name.startswith("trl_dta.train.") or name == "trl_dta.train":
            continue
        mine = folder_of(name)
        for dep in deps:
            theirs = folder_of(dep)
            if mine is None:  # the seam (train/'s root files)
                assert theirs is None, f"the seam's {name} imports {dep} (train/{theirs}/)"
            elif mine in METHODS:
                assert theirs in (None, mine, *MODEL_PASSES), f"{name} ({mine}/) imports {dep} ({theirs}/)"
            else:
                assert theirs in (None, mine), f"the model pass {name} ({mine}/) imports {dep} ({theirs}/)"


def test_a_model_pass_folder_holds_a_model_pass():
    """Each model pass folder has a class built with the trainer (``for_trainer``): what
    trl_dta/train/model_pass.py's protocols describe; the value model meets the trained one's."""
    from trl_dta.train.critic.value_model import ValueModel
    from trl_dta.train.model_pass import ModelPass, TrainedPass

    for folder in MODEL_PASSES:
        classes = [
            node.name
            for path in (PACKAGE / "train" / folder).glob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)
            and any(isinstance(f, ast.FunctionDef) and f.name == "for_trainer" for f in node.body)
        ]
        assert classes, f"train/{folder}/ has no trainer.py and no model pass (a class with for_trainer)"
    assert issubclass(ValueModel, TrainedPass) and issubclass(ValueModel, ModelPass)


def _all_imports(path: Path) -> set[str]:
    """Every module of the package ``path`` imports, deferred (inside functions) and annotation-only
    (``if TYPE_CHECKING:``) imports included."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            out.update({f"{target}.{alias.name}" for alias in node.names} & set(MODULES) or {target})
    return {m for m in out if m in MODULES and m != module_name(path)}


def test_no_import_cycle_in_the_package():
    """No module of trl_dta/ reaches itself through imports: at run time, deferred into a function, or for
    annotations only (a cycle closed by a deferred import is a cycle all the same). A package importing its
    own modules (its __init__) is not a cycle."""
    graph = {name: _all_imports(path) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if dep.startswith(name + ".") or name.startswith(dep + "."):  # (a package and its own modules)
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep] if dep in path else [name, dep]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_library_file_reads_in_one_sitting(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
    assert "fmt: skip" not in text and "fmt: off" not in text
