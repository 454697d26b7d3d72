"""The layering rule, read from the imports of every module (with `ast`, nothing imported).

    cli → app → observability, chain, ingress → upstream → routing → state, config → base

A module may import its own layer and the layers this table allows, never one above. Imports
under `if TYPE_CHECKING:` are type-only (no runtime dependency) and are not counted: the
request context names the tenant, intent and endpoint types of the layers that fill them in.
`state` is a leaf: it may use nothing of kvgate but the background-task helper. Only `cli`
imports the simulator, and the simulator imports nothing of the gateway but `sim_text`: the
simulator's tokenizer and chat template, which the gateway uses to compute the token ids a
simulated engine sees (precise prefix routing), and the KV-event field layout both speak.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvgate"

# Modules that are not in a package of their own layer.
_MODULE_LAYERS = {
    "kvgate": "base",
    "kvgate.errors": "base",
    "kvgate.types": "base",
    "kvgate.asgi": "base",
    "kvgate.background": "base",
    "kvgate.globs": "base",
    "kvgate.yaml_source": "base",
    "kvgate.request_options": "base",
    "kvgate.prompt_view": "base",
    "kvgate.body_members": "base",
    "kvgate.config": "config",
    "kvgate.chain.settings": "config",
    "kvgate.routing.settings": "config",
    "kvgate.upstream.settings": "config",
    "kvgate.ingress": "ingress",
    "kvgate.app": "app",
    "kvgate.hot_reload": "app",
    "kvgate.fleet_admin": "app",
    "kvgate.reload_carryover": "app",
    "kvgate.cors": "app",
    "kvgate.cli": "cli",
    "kvgate.demo": "cli",
    "kvgate.serving": "cli",
    "kvgate.worker_supervisor": "cli",
    "kvgate.http_server": "base",
    "kvgate.sim_tokenizer": "sim_text",
    "kvgate.sim_chat_template": "sim_text",
    "kvgate.kv_event_fields": "sim_text",
}
_BELOW = {
    "base": set(),
    "sim_text": set(),
    "config": {"base"},
    "state": set(),
    "routing": {"base", "config", "state", "sim_text"},
    "upstream": {"base", "config", "state", "sim_text", "routing"},
    "ingress": {"base"},
    "chain": {"base", "config", "state", "sim_text", "routing", "ingress"},
    "observability": {"base", "config", "state", "sim_text", "routing", "upstream", "chain"},
    "app": {"base", "config", "state", "sim_text", "routing", "upstream", "ingress", "chain",
            "observability"},
    "cli": {"base", "config", "state", "sim_text", "routing", "upstream", "ingress", "chain",
            "observability", "app", "sim"},
    "sim": {"sim_text"},
}  # fmt: skip
# The one module of kvgate that state may use.
_STATE_MAY_USE = {"kvgate.background"}


def layer_of(module: str) -> str:
    for name in sorted(_MODULE_LAYERS, key=len, reverse=True):
        if module == name or (name != "kvgate" and module.startswith(name + ".")):
            return _MODULE_LAYERS[name]
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in _BELOW:
        return parts[1]
    return "base"


def _runtime_imports(tree: ast.Module, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every kvgate import outside `if TYPE_CHECKING:`."""
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                type_only.update(id(n) for n in ast.walk(inner))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvgate")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvgate"):
            base = node.module
            found += [(node.lineno, base)]
            # `from kvgate.routing import filters` imports the module kvgate.routing.filters
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def violations(root: Path) -> list[str]:
    """Every import of a layer the importing module may not use, as `file:line: a -> b`."""
    known = {_module_name(p, root) for p in root.rglob("*.py")}
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        mine = layer_of(module)
        reported: set[int] = set()  # one problem per import statement
        for line, imported in _runtime_imports(ast.parse(path.read_text()), module):
            if imported not in known or line in reported:
                continue  # a name imported from a module, not a module
            theirs = layer_of(imported)
            if theirs == mine and not (mine == "sim" and not imported.startswith("kvgate.sim")):
                continue
            allowed = theirs in _BELOW[mine] or (mine == "state" and imported in _STATE_MAY_USE)
            if not allowed:
                where = path.relative_to(root.parent)
                reported.add(line)
                problems.append(f"{where}:{line}: {module} ({mine}) -> {imported} ({theirs})")
    return problems


def test_no_module_imports_a_layer_above_its_own():
    assert violations(PACKAGE) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("state/leak.py", "from kvgate.chain.admission import Capacity\n", "(state) -> "),
        ("routing/up.py", "import kvgate.app\n", "(routing) -> kvgate.app (app)"),
        ("chain/x.py", "from kvgate.upstream import forwarder\n", "(chain) -> kvgate.upstream"),
        ("app.py", "from kvgate.sim import fleet\n", "kvgate.app (app) -> kvgate.sim"),
        ("sim/x.py", "from kvgate.routing import router\n", "(sim) -> kvgate.routing"),
    ],
)
def test_a_planted_violation_is_reported(tmp_path, module, source, expected):
    root = tmp_path / "kvgate"
    for package in ("", "state", "routing", "chain", "upstream", "sim"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for leaf in ("app.py", "chain/admission.py", "upstream/forwarder.py", "sim/fleet.py",
                 "routing/router.py"):  # fmt: skip
        (root / leaf).write_text("")
    (root / module).write_text(source)
    found = violations(root)
    assert len(found) == 1 and expected in found[0], found


def test_type_only_imports_are_not_counted(tmp_path):
    root = tmp_path / "kvgate"
    (root / "state").mkdir(parents=True)
    (root / "chain").mkdir()
    for init in (root / "__init__.py", root / "state/__init__.py", root / "chain/__init__.py"):
        init.write_text("")
    (root / "chain" / "intent.py").write_text("")
    (root / "state" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvgate.chain import intent\n"
    )
    assert violations(root) == []


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles in the graph of runtime imports between kvgate modules."""
    known = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {
        module: {m for _, m in _runtime_imports(ast.parse(path.read_text()), module) if m in known}
        - {module}
        for module, path in known.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_runtime_import_cycle():
    assert import_cycles(PACKAGE) == []


def test_a_planted_cycle_is_found(tmp_path):
    root = tmp_path / "kvgate"
    (root / "routing").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "routing" / "__init__.py").write_text("")
    (root / "routing" / "a.py").write_text("from kvgate.routing import b\n")
    (root / "routing" / "b.py").write_text("from kvgate.routing.a import X\n")
    assert import_cycles(root) == [["kvgate.routing.a", "kvgate.routing.b", "kvgate.routing.a"]]
