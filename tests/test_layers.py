"""The package's layers import only downward, with no cycles, and only the CLI imports Typer.

Every `import` in every module counts, also those inside functions: a lazy import that dodges a
cycle is still a cycle, and one that reaches up is still a layer broken. The order (architecture §2):
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moelab"

LAYERS = [  # low to high; a module may import its own layer or a lower one
    ["errors", "files", "config", "presets", "accounting"],  # what a run is; files written whole
    ["data", "model"],  # tokens in, logits out
    ["parallel"],  # meshes, shardings, expert-parallel dispatch
    ["train"],  # one run
    ["ladder", "evals", "export"],  # use finished or running runs
    ["lab"],  # experiments
    ["cli"],  # the `moelab` command
]
LAYER_OF = {name: level for level, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module this file imports (absolute names), from any scope."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from moelab import config`
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    if top not in LAYER_OF:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (architecture §2) or move it")
    return LAYER_OF[top]


def test_every_module_belongs_to_a_layer():
    for module in MODULES:
        if module != "moelab":
            _layer(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "moelab"))
def test_a_module_imports_only_its_own_layer_or_lower_ones(module):
    upward = sorted(m for m in GRAPH[module] if m != "moelab" and _layer(m) > _layer(module))
    assert not upward, f"{module} (layer {_layer(module)}) imports a higher layer: {upward}"


def test_the_package_has_no_import_cycles():
    """Depth-first search over the whole import graph, local imports included."""
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_only_the_cli_package_imports_typer():
    outside = sorted(name for name, path in MODULES.items()
                     if not name.startswith("moelab.cli") and any(m.split(".")[0] == "typer" for m in _imports(path)))
    assert not outside, f"typer imported outside moelab/cli/: {outside}"


def test_the_graph_is_not_empty():
    """The walk above sees the package's real imports (a broken walk would pass every test)."""
    assert "moelab.config" in GRAPH["moelab.train.loop"] and len(MODULES) > 30


def test_every_architecture_reference_names_a_section_of_the_repositorys_own_document():
    """Docstrings cite `docs/architecture.md` as "architecture §N"; a clone must be able to follow each one,
    and nothing may point at the design file that lived beside the repository."""
    import re

    root = PACKAGE.parents[1]
    sections = set(re.findall(r"^## (\d+[a-z]?)\.", (root / "docs" / "architecture.md").read_text(), re.M))
    files = [p for folder in ("src", "tests", "benchmarks", "docs") for p in (root / folder).rglob("*")
             if p.suffix in (".py", ".md", ".sh") and p.name != "test_layers.py"] + [root / "README.md"]
    cited, stale = set(), []
    for path in files:
        text = path.read_text()
        cited |= set(re.findall(r"architecture §(\d+[a-z]?)", text))
        if re.search(r"design\.md|design §", text):
            stale.append(path.name)
    assert not stale, stale
    assert cited and cited <= sections, cited - sections
