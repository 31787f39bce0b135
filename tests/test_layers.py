"""lcx's packages form layers: each imports only from layers below its own (`LAYERS`, the order
docs/contributing.md declares), and there is no import cycle between packages (`lcx.hf`,
`lcx.methods`, ...) or between modules, counting every import a module can run (top-level and
inside functions; only `if TYPE_CHECKING:` blocks are left out, since they never run). An
in-function import that reaches back up a layer is a violation here, so it cannot hide one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed name -> source folder (pyproject's package-dir)
PACKAGE_DIRS = {"lcx": ROOT / "lcx", "lcx.kernels": ROOT / "kernels", "lcx.serve": ROOT / "serve",
                "lcx.eval_tasks": ROOT / "eval_tasks"}

# The layers, bottom up: a package imports only from strictly lower layers. `lcx` itself (its
# __init__ re-exports lazily from every layer) is outside them. docs/contributing.md states
# this order in the line that `layers_line()` renders.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("allocator",),  # process set-up that lcx.data's environment() records
    ("rope", "masks", "data", "configs", "threads", "stats", "truncation"),
    ("kernels", "testing"),
    ("attention",),
    ("methods",),
    ("hf",),
    ("cache", "method_config"),
    ("models",),
    ("presets",),  # (`string` reads a model's config: `lcx.presets.model_rope`)
    ("engine", "eval", "_lmeval_hook"),
    ("eval_tasks", "lmeval_model", "serve", "demo"),
    ("report", "train", "cli"),
)
# The experiments: top-level packages beside lcx/, outside its layers (lcx.cli.EXPERIMENTS). They
# import anything from lcx; lcx never imports them, and a study never imports a benchmark.
EXPERIMENT_DIRS = {"benchmarks": ROOT / "benchmarks", "studies": ROOT / "studies"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for name, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if "assets" in parts or "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([name, *parts])] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the lcx modules it imports (anywhere in its body)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        here = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = here
                if node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - (node.level - 1)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                while name not in mods and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in mods and name != mod and name.startswith("lcx"):
                    targets.add(name)
        graph[mod] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def package_of(module: str) -> str:
    """`lcx.hf.attention_patch` -> `lcx.hf`; a top-level module (`lcx.report`) is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        a = package_of(mod)
        for t in targets:
            b = package_of(t)
            if a != b and "lcx" not in (a, b):  # lcx/__init__ re-exports lazily from every layer
                out.setdefault(a, set()).add(b)
    return out


def _edges_within(graph: dict[str, set[str]], comp: list[str], by_package: bool) -> list[str]:
    members = set(comp)
    key = package_of if by_package else (lambda m: m)
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                  if key(m) in members and key(t) in members and key(m) != key(t))


def layers_line() -> str:
    return "Layers, bottom up: " + " < ".join(", ".join(layer) for layer in LAYERS)


def layer_of() -> dict[str, int]:
    return {f"lcx.{name}": i for i, layer in enumerate(LAYERS) for name in layer}


def layer_violations(pkg_graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Edges a -> b whose target is not in a strictly lower layer (or a package no layer names)."""
    bad = [f"{p}: in no layer of LAYERS" for p in sorted(set(pkg_graph) | {t for ts in pkg_graph.values() for t in ts})
           if p not in layers]
    bad += [f"{a} (layer {layers[a]}) -> {b} (layer {layers[b]})" for a, ts in sorted(pkg_graph.items())
            for b in sorted(ts) if a in layers and b in layers and layers[b] >= layers[a]]
    return bad


def test_packages_import_only_from_lower_layers():
    graph = import_graph()
    bad = layer_violations(package_graph(graph), layer_of())
    assert not bad, "imports against the declared layers (tests/test_layers.py LAYERS):\n  " + "\n  ".join(bad)


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in import_graph()} - {"lcx"}
    missing = sorted(p for p in packages if p not in layer_of())
    assert not missing, f"packages in no layer of LAYERS: {missing}"


def test_docs_declare_the_same_layers():
    text = (ROOT / "docs" / "contributing.md").read_text()
    assert layers_line() in text, f"docs/contributing.md must state the layers as tests/test_layers.py does:\n{layers_line()}"


def test_the_layer_check_finds_an_upward_import():
    layers = {"lcx.low": 0, "lcx.mid": 1, "lcx.top": 2}
    assert layer_violations({"lcx.top": {"lcx.mid", "lcx.low"}, "lcx.mid": {"lcx.low"}}, layers) == []
    assert layer_violations({"lcx.low": {"lcx.top"}}, layers) == ["lcx.low (layer 0) -> lcx.top (layer 2)"]
    assert layer_violations({"lcx.mid": {"lcx.mid2"}}, {**layers, "lcx.mid2": 1}) == [
        "lcx.mid (layer 1) -> lcx.mid2 (layer 1)"]
    assert layer_violations({"lcx.new": {"lcx.low"}}, layers) == ["lcx.new: in no layer of LAYERS"]


def test_no_import_cycle_between_packages():
    graph = import_graph()
    found = cycles(package_graph(graph))
    assert not found, "import cycles between lcx packages:\n" + "\n".join(
        f"{comp}:\n  " + "\n  ".join(_edges_within(graph, comp, True)) for comp in found)


def test_no_import_cycle_between_modules():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles between lcx modules:\n" + "\n".join(
        f"{comp}:\n  " + "\n  ".join(_edges_within(graph, comp, False)) for comp in found)


def test_the_checker_finds_a_cycle():
    """The check itself can fail: a two-package cycle and a three-module cycle are found."""
    assert cycles(package_graph({"lcx.a.x": {"lcx.b.y"}, "lcx.b.y": {"lcx.a.z"}, "lcx.a.z": set()})) == [
        ["lcx.a", "lcx.b"]]
    assert cycles({"m1": {"m2"}, "m2": {"m3"}, "m3": {"m1"}, "m4": {"m1"}}) == [["m1", "m2", "m3"]]
    graph = import_graph()
    assert "lcx.hf.attention_patch" in graph and "lcx.methods.registry" in graph["lcx.hf.attention_patch"]


def test_test_module_names_are_unique():
    """tests/ has no packages: two test files with one basename stop pytest from collecting."""
    seen: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        other = seen.setdefault(path.name, str(path.relative_to(ROOT)))
        assert other == str(path.relative_to(ROOT)), f"{path.relative_to(ROOT)} and {other} share a basename"


def _imported_names(path: Path) -> set[str]:
    """Every absolute module name a file imports (anywhere in its body, TYPE_CHECKING left out)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


def test_the_library_never_imports_an_experiment():
    """lcx (and lcx.kernels, lcx.serve, lcx.eval_tasks) never imports benchmarks/ or studies/;
    studies never import benchmarks/."""
    bad = [f"{mod} imports {name}" for mod, path in sorted(_modules().items()) for name in sorted(_imported_names(path))
           if name.split(".")[0] in EXPERIMENT_DIRS]
    bad += [f"{path.relative_to(ROOT)} imports {name}" for path in sorted(EXPERIMENT_DIRS["studies"].rglob("*.py"))
            for name in sorted(_imported_names(path)) if name.split(".")[0] == "benchmarks"]
    assert not bad, "\n".join(bad)
    from lcx.cli import EXPERIMENTS

    assert set(EXPERIMENTS) == set(EXPERIMENT_DIRS)
    assert all((d / "__init__.py").is_file() for d in EXPERIMENT_DIRS.values())
