"""The import graph of `treadle`, built from the source with `ast`: no cycles, and the
layers' arrows point down (docs/architecture.md). Every import counts, lazy ones in a
function and `TYPE_CHECKING` ones too: each is a dependency of the module."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# What each package may import (besides itself, `treadle.errors`, `treadle.types`,
# `treadle.clock` and the root package). The table of docs/architecture.md, as data.
LAYERS: dict[str, set[str]] = {
    "testing": set(),  # test doubles shipped for tests; nothing in src imports it
    "examples": set(),  # harnesses that know only the OpenAI API; nothing imports them
    "workloads": set(),
    "page": set(),
    "reports": set(),
    "served": set(),
    "core": set(),
    "store": set(),
    "rewards": set(),  # rubrics, verdicts, judging through a lane it is given
    "sandbox": {"served"},
    "engines": {"core", "served"},
    "envs": {"sandbox"},
    "agent": {"engines", "envs"},
    "client": {"store"},
    "sim": {"core", "workloads", "page"},
    "runtime": {"core", "engines", "envs", "agent", "sandbox", "workloads", "rewards"},
    "gateway": {"runtime", "core", "engines", "envs", "agent", "sandbox"},
    "service": {"gateway", "runtime", "store", "core", "engines", "envs", "agent", "sandbox",
                "served", "workloads", "page", "rewards"},
    "run": {"service", "gateway", "client", "store", "envs", "sandbox", "served", "workloads",
            "page"},
    "train": {"client", "runtime", "agent", "envs", "engines", "sandbox"},
    "bench": {"sim", "runtime", "service", "sandbox", "core", "engines", "workloads",
              "reports", "served", "client", "store"},
}
_FREE = {"errors", "types", "clock", ""}  # importable from anywhere (clock: not core)
# The modules that may import Ray (the optional `ray` extra), each only inside its
# functions, so that treadle installs and imports without it.
RAY_MODULES = {"treadle.runtime.ray_launcher", "treadle.runtime.ray_sandboxes",
               "treadle.runtime.ray_runners", "treadle.runtime.runner_actor"}
# verl's checkpoint engine: loaded only inside a verl trainer's process, which runs on
# its own Ray (and its own virtualenv, .venv-verl).
TRAINER_RAY_MODULES = {"treadle.client.verl_weights"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "treadle").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The treadle modules `name` imports (a `from pkg import x` of a submodule x
    counts as importing pkg.x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("treadle") and target != name:
                yield target
                break


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imports(name, path, modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if any (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path = [root]
        stack = [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_no_module_of_treadle_imports_itself_back() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_arrows_point_down_the_layers(package: str) -> None:
    up = sorted(f"{m} -> {t}" for m, targets in _graph().items() if _package(m) == package
                for t in targets
                if _package(t) not in {package, *_FREE, *LAYERS[package]})
    assert not up, "imports against the layers:\n" + "\n".join(up)


def test_the_core_reads_no_clock_and_nothing_imports_the_test_doubles() -> None:
    core = sorted(f"{m} -> {t}" for m, targets in _graph().items() if _package(m) == "core"
                  for t in targets if t == "treadle.clock")
    assert not core, "core/ takes time as an argument:\n" + "\n".join(core)
    users = sorted(m for m, targets in _graph().items() if "treadle.testing" in targets)
    assert not users, f"treadle.testing is for tests: {users}"


def test_every_package_has_a_layer() -> None:
    packages = {_package(m) for m in _graph()} - _FREE
    assert packages <= set(LAYERS) | {"cli", "demo", "__main__"}, packages - set(LAYERS)


def _ray_imports(path: Path) -> Iterator[tuple[int, bool]]:
    """(line, inside a function) of each import of `ray` in the module at `path`."""
    tree = ast.parse(path.read_text(), str(path))
    lazy = {id(node) for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) for node in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        if "ray" in roots:
            yield node.lineno, id(node) in lazy


def test_only_the_ray_modules_import_ray_and_only_in_functions() -> None:
    found = {name: list(_ray_imports(path)) for name, path in _modules().items()}
    outside = sorted(f"{name}:{line}" for name, imports in found.items()
                     if name not in RAY_MODULES | TRAINER_RAY_MODULES for line, _ in imports)
    assert not outside, f"Ray imported outside {sorted(RAY_MODULES)}: {outside}"
    eager = sorted(f"{name}:{line}" for name in RAY_MODULES for line, lazy in found[name]
                   if not lazy)
    assert not eager, f"Ray imported at module level (the base install has none): {eager}"
    assert all(found[name] for name in RAY_MODULES), "a Ray module that imports no Ray"
