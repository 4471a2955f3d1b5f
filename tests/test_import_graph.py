"""The packages' import graph: no circle between modules, layers import downwards only
(rl_integration -> scheduler -> drafter -> rollout), and no package imports benchmarks/ or tests/.
Inside rollout the rooms import downwards too: vllm_backend -> core, proposers, budget -> kernels.
core, proposers and budget import each other (core's engine runs the proposers and the budget, which
take core's Request), so they share a rank; proposers and budget use nothing of core but its Request.
rollout's top-level modules (config, backend, cpu, lazy) are the seams between rooms and have no rank.

The graph is read from the source (ast), every import statement included: module level, inside
functions, relative ones. A lazy package __init__ (rollout, rl_integration) names the modules its
names load from in `_EXPORTS`; those count as its imports."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("rollout", "drafter", "scheduler", "rl_integration")  # each may import those before it
FORBIDDEN = ("benchmarks", "tests")
# rollout's rooms (rollout/<room>/): each may import those of a lower rank
ROOMS = {"kernels": 0, "core": 1, "proposers": 1, "budget": 1, "vllm_backend": 2}
ROOM_ORDER = "kernels < core, proposers, budget < vllm_backend"
CORE_REQUEST = "rollout.core.request"  # all that proposers and budget take from core


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in LAYERS for p in sorted((ROOT / pkg).rglob("*.py"))}


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, modules) -> str | None:
    """`name`, or its longest prefix that is one of `modules`; a name outside them is kept when
    its top-level package is a forbidden one (so an import of it is seen), else None (third party)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return name if parts[0] in FORBIDDEN else None


def imports_of(module: str, path: Path, modules) -> set[str]:
    """The modules of `modules` (and of the forbidden packages) that `module`'s source imports."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            for a in node.names:  # `from pkg import sub` imports pkg.sub when that is a module
                found.add(_known(f"{base}.{a.name}", modules) if f"{base}.{a.name}" in modules
                          else _known(base, modules))
        elif is_package and isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            found.update(_known(_absolute(module, True, 1, v.value.lstrip(".")), modules)
                         for v in node.value.values if isinstance(v, ast.Constant))
    return {m for m in found if m and m != module}


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str | None:
    """The room of rollout that `module` sits in (rollout/<room>/), else None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rollout" and len(parts) > 1 and parts[1] in ROOMS else None


def violations(graph: dict[str, set[str]]) -> list[str]:
    """What is wrong with a module graph {module: modules it imports}: circles, imports from a lower
    layer to a higher one (or from a lower room of rollout to a higher one), and imports of
    benchmarks/ or tests/. Empty when all is well."""
    rank = {pkg: i for i, pkg in enumerate(LAYERS)}
    found = [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    for module, targets in sorted(graph.items()):
        here = module.split(".")[0]
        for target in sorted(targets):
            there = target.split(".")[0]
            if there in FORBIDDEN:
                found.append(f"{module} imports {target}: a package never imports {there}/")
            elif there in rank and here in rank and rank[there] > rank[here]:
                found.append(f"{module} imports {target}: {here} sits below {there} ({' -> '.join(reversed(LAYERS))})")
            elif (a := room(module)) and (b := room(target)) and a != b:
                if ROOMS[b] > ROOMS[a]:
                    found.append(f"{module} imports {target}: room {a} sits below room {b} ({ROOM_ORDER})")
                elif b == "core" and a in ("proposers", "budget") and target != CORE_REQUEST:
                    found.append(f"{module} imports {target}: {a} takes only {CORE_REQUEST} from core")
    return found


def test_the_packages_import_graph_has_no_circle_no_upward_import_and_no_benchmarks():
    graph = import_graph()
    assert len(graph) > 50 and "rollout.core.engine" in graph["rollout"]  # the lazy __init__'s names count
    assert "rollout.core.sampling" in graph["rollout.core.engine"]
    assert "rollout.vllm_backend.backend" in graph["rollout.vllm_backend"]
    assert {room(m) for m in graph} >= set(ROOMS)  # every room is seen
    assert violations(graph) == []


def test_the_graph_sees_relative_function_level_and_submodule_imports(tmp_path):
    modules = {"drafter": None, "drafter.head": None, "drafter.proposer": None, "rollout": None, "rollout.core": None,
               "rollout.core.engine": None}
    src = tmp_path / "drafter" / "proposer.py"
    src.parent.mkdir()
    src.write_text("from .head import X\nfrom rollout.core import engine\n"
                   "def f():\n    from benchmarks.bench import save_report\n    import scheduler.worker\n")
    assert imports_of("drafter.proposer", src, modules) == {"drafter.head", "rollout.core.engine", "benchmarks.bench"}
    init = tmp_path / "drafter" / "__init__.py"
    init.write_text("from . import head\n_EXPORTS = {'P': '.proposer'}\n")
    assert imports_of("drafter", init, modules) == {"drafter.head", "drafter.proposer"}


@pytest.mark.parametrize("planted, message", [
    ({"rollout.a": {"rollout.b"}, "rollout.b": {"rollout.c"}, "rollout.c": {"rollout.a"}},
     "import circle: rollout.a -> rollout.b -> rollout.c"),
    ({"rollout.core.engine": {"drafter.proposer"}, "drafter.proposer": set()},
     "rollout.core.engine imports drafter.proposer: rollout sits below drafter"),
    ({"scheduler.worker": {"rl_integration.config"}}, "scheduler.worker imports rl_integration.config: scheduler sits"),
    ({"drafter.head": {"benchmarks.bench"}},
     "drafter.head imports benchmarks.bench: a package never imports benchmarks/"),
    ({"rollout.core.engine": {"tests.conftest"}},
     "rollout.core.engine imports tests.conftest: a package never imports tests/"),
    ({"rollout.kernels.ops": {"rollout.core.batch"}},
     "rollout.kernels.ops imports rollout.core.batch: room kernels sits below room core"),
    ({"rollout.core.model": {"rollout.vllm_backend.config"}},
     "rollout.core.model imports rollout.vllm_backend.config: room core sits below room vllm_backend"),
    ({"rollout.proposers.base": {"rollout.core.engine"}},
     "rollout.proposers.base imports rollout.core.engine: proposers takes only rollout.core.request from core"),
])
def test_a_planted_violation_is_found(planted, message):
    clean = {"rl_integration.cli": {"scheduler.worker", "rollout"}, "scheduler.worker": {"drafter.head"},
             "drafter.head": {"rollout.core.engine"}, "rollout": {"rollout.core.engine"},
             "rollout.core.engine": {"rollout.kernels.ops", "rollout.proposers.base", "rollout.budget.budget"},
             "rollout.proposers.base": {"rollout.core.request"}, "rollout.budget.budget": {"rollout.core.request"},
             "rollout.vllm_backend.backend": {"rollout.core.model", "rollout.kernels.cpu_isa"}}
    assert violations(clean) == []
    graph = {m: set(t) for m, t in clean.items()}
    for module, targets in planted.items():
        graph.setdefault(module, set()).update(targets)
    assert any(v.startswith(message) for v in violations(graph)), violations(graph)
