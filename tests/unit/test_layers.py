"""The import graph runs one way: no circles, and no module imports from a layer above its own.

The layers, lowest first (README "How it works", docs/design.md "Package map"). A module may
import its own layer's modules (without a circle) and anything below. `data_pipelines/` sits
beside the package and imports only the dataset format below it; only the CLI, the top, imports
it. `validation/` (the published-run checks, not shipped) imports the package and nothing of the
package imports it. Every import counts, function-level ones too: a lazy import still ties the
modules together. Pure file reading: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LAYERS: list[tuple[str, ...]] = [
    ("elastic_gpt", "elastic_gpt.console", "elastic_gpt.errors", "elastic_gpt.arguments",
     "elastic_gpt.torch_internals", "elastic_gpt.hardware", "elastic_gpt.model"),
    ("elastic_gpt.tracking", "elastic_gpt.data", "elastic_gpt.parallel", "elastic_gpt.cost_model"),
    ("elastic_gpt.config", "elastic_gpt.config_types"),
    ("elastic_gpt.checkpoint",),
    ("elastic_gpt.health",),
    ("elastic_gpt.train", "elastic_gpt.inference"),
    ("elastic_gpt.elastic",),
    ("elastic_gpt.planner", "elastic_gpt.dry_run"),
    ("elastic_gpt.cli", "elastic_gpt.testing"),
]
# What data_pipelines may import of the package (and each other).
PIPELINES_MAY_IMPORT = ("elastic_gpt.data", "elastic_gpt.console", "elastic_gpt.errors")
MAX_MODULE_LINES = 650


def _modules() -> dict[str, Path]:
    mods = {}
    for root in ("elastic_gpt", "data_pipelines", "validation"):
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules `name` imports (anywhere in it), resolved to modules of MODULES."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int | None:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "elastic_gpt" and module.startswith(prefix + ".")):
                best = index
    return best


def test_every_package_module_has_a_layer():
    assert not [m for m in MODULES if m.startswith("elastic_gpt") and _layer(m) is None]


def test_no_import_runs_up_a_layer():
    upward = []
    for module, targets in GRAPH.items():
        if not module.startswith("elastic_gpt"):
            continue
        for target in targets:
            if target.startswith("validation"):
                upward.append(f"{module} -> {target} (validation/ checks the package; the "
                              "package never imports it)")
            elif target.startswith("data_pipelines"):
                if module != "elastic_gpt.cli":
                    upward.append(f"{module} -> {target} (only the CLI runs data_pipelines)")
            elif _layer(target) > _layer(module):
                upward.append(f"{module} (layer {_layer(module)}) -> {target} "
                              f"(layer {_layer(target)})")
    assert not upward, "imports that run up:\n" + "\n".join(sorted(upward))


def test_data_pipelines_import_only_the_dataset_format():
    bad = [f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith("data_pipelines")
           for t in targets if not t.startswith(("data_pipelines", *PIPELINES_MAY_IMPORT))]
    assert not bad, "\n".join(sorted(bad))


def test_nothing_of_the_package_imports_the_validation_wing():
    """Spelled out apart from the layers: the product plans this trainer's layouts, and the
    software of the published runs lives in validation/ only."""
    assert [m for m in MODULES if m.startswith("validation.")], "validation/ not scanned"
    bad = [f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith(("elastic_gpt",
                                                                             "data_pipelines"))
           for t in targets if t.startswith("validation")]
    assert not bad, "\n".join(sorted(bad))


def test_no_circles():
    """Tarjan's strongly connected components: every one must be a single module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_the_size_a_reader_holds(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines; split it by concern"


def test_the_layering_check_sees_a_circle_and_an_upward_import(monkeypatch):
    """The checks above can fail: a made-up graph with both faults."""
    fake = {"elastic_gpt.model.gpt": {"elastic_gpt.train.trainer"},
            "elastic_gpt.train.trainer": {"elastic_gpt.model.gpt"}}
    monkeypatch.setitem(globals(), "GRAPH", fake)
    with pytest.raises(AssertionError, match="import circles"):
        test_no_circles()
    monkeypatch.setitem(globals(), "MODULES", {m: Path() for m in fake})
    with pytest.raises(AssertionError, match="imports that run up"):
        test_no_import_runs_up_a_layer()
    wing = {"elastic_gpt.planner.report": {"validation.checks"}, "validation.checks": set()}
    monkeypatch.setitem(globals(), "GRAPH", wing)
    monkeypatch.setitem(globals(), "MODULES", {m: Path() for m in wing})
    with pytest.raises(AssertionError, match="validation.checks"):
        test_nothing_of_the_package_imports_the_validation_wing()
