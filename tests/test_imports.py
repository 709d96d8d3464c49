"""The project's imports, read from the source with ast (top-level and inside functions): no cycle, a
script imports another only where the design has it, and the data side loads no torch."""

import ast
import functools
import graphlib
from collections import deque
from typing import NamedTuple

import pytest

from helpers import ROOT

PACKAGES = ("support", "benchmarks")
SCRIPTS = ("train_gpt2", "sample", "export_hf", "fineweb", "hellaswag", "bench")
# The design's script -> script imports (training runs hellaswag's eval, sample.py the recipe's model, the
# benchmarks measure the scripts); nothing else, and support/ imports no script and nothing of benchmarks/.
ALLOWED_SCRIPT_IMPORTS = {
    "train_gpt2": {"hellaswag"},
    "sample": {"train_gpt2"},
    "bench": {"train_gpt2", "hellaswag", "fineweb"},
    "benchmarks": {"train_gpt2", "hellaswag", "fineweb"},
}
# fineweb.py starts without torch, and so do the support modules the data side shares with it
TORCH_FREE = ("fineweb.py", *(f"support/{name}.py" for name in ("cli", "files", "offline", "documents", "shards")))


class Import(NamedTuple):
    """One module an import statement names (absolute) in path at line; local: inside a function."""

    target: str
    path: str
    line: int
    local: bool

    def where(self):
        return f"{self.path}:{self.line}" + (" (inside a function)" if self.local else "")


def project_modules(root):
    """{module name: its file}: the top-level .py files, support/'s and benchmarks/' (__init__.py as the package)."""
    modules = {p.stem: p for p in sorted(root.glob("*.py"))}
    for package in PACKAGES:
        for p in sorted((root / package).glob("*.py")):
            modules[package if p.stem == "__init__" else f"{package}.{p.stem}"] = p
    return modules


def imports_in(module, path, root):
    """An Import per module each import statement in path names (`from a import b`: a, and a.b)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    rel = str(path.relative_to(root))
    found = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, rel, child.lineno, local) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, up level - 1 packages
                    parts = package.split(".") if package else []
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join([*parts, *([base] if base else [])])
                found.append(Import(base, rel, child.lineno, local))
                found.extend(Import(f"{base}.{alias.name}", rel, child.lineno, local) for alias in child.names)
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def import_graph(root):
    """(project, external): project[a][b], the Imports by which module a imports project module b (`import
    a.b.c` imports a, a.b and a.b.c); external[a], a's Imports of other modules, by their top-level name."""
    modules = project_modules(root)
    project, external = {m: {} for m in modules}, {m: [] for m in modules}
    for module, path in modules.items():
        for imp in imports_in(module, path, root):
            parts = imp.target.split(".")
            names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            ours = [name for name in names if name in modules]
            for name in ours:
                edge = project[module].setdefault(name, [])
                if imp._replace(target=name) not in edge:  # `from a import b` names a, and a.b
                    edge.append(imp._replace(target=name))
            if not ours and imp.target and imp._replace(target=parts[0]) not in external[module]:
                external[module].append(imp._replace(target=parts[0]))
    return project, external


def find_cycle(graph):
    """A cycle of graph ({node: its successors}) as [a, b, ..., a] from its least node, or None (graphlib)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        ring = e.args[1][:0:-1]  # graphlib lists a node before the one importing it: reversed, the repeat dropped
        first = ring.index(min(ring))
        return ring[first:] + ring[: first + 1]
    return None


def describe_cycle(cycle, project):
    """'a -> b -> a' and, a line an edge, where each import is."""
    lines = [" -> ".join(cycle)]
    for a, b in zip(cycle, cycle[1:], strict=False):  # each edge: a node and the next
        lines.append(f"    {a} -> {b}: " + ", ".join(imp.where() for imp in project[a][b]))
    return "\n".join(lines)


def forbidden_imports(project):
    """(importer, imported, its Imports) outside ALLOWED_SCRIPT_IMPORTS, and support/ importing benchmarks/."""
    bad = []
    for a, targets in sorted(project.items()):
        for b, imps in sorted(targets.items()):
            owner_a, owner_b = a.split(".")[0], b.split(".")[0]  # the script or the package (support, benchmarks)
            to_script = b in SCRIPTS and b != a and b not in ALLOWED_SCRIPT_IMPORTS.get(owner_a, ())
            if to_script or (owner_a == "support" and owner_b == "benchmarks"):
                bad.append((a, b, imps))
    return bad


def torch_paths(start, project, external):
    """(the shortest chain of modules from start to one that imports torch, that Import) for each such module."""
    chains, queue = {start: [start]}, deque([start])
    while queue:  # breadth first: each module is reached first by a shortest chain
        node = queue.popleft()
        for succ in sorted(project[node]):
            if succ not in chains:
                chains[succ] = [*chains[node], succ]
                queue.append(succ)
    return [(chains[m], imp) for m in sorted(chains) for imp in external[m] if imp.target == "torch"]


@functools.cache
def project_graph():
    """import_graph of the repository, read once."""
    return import_graph(ROOT)


def test_the_project_modules_import_one_another_in_no_cycle():
    project, _ = project_graph()
    cycle = find_cycle({a: set(targets) for a, targets in project.items()})
    if cycle:
        pytest.fail(f"an import cycle:\n{describe_cycle(cycle, project)}")


def test_a_script_imports_another_script_only_as_designed():
    project, _ = project_graph()
    bad = forbidden_imports(project)
    if bad:
        design = "; ".join(f"{a} -> {', '.join(sorted(b))}" for a, b in ALLOWED_SCRIPT_IMPORTS.items())
        said = "\n".join(f"{a} -> {b}: " + ", ".join(imp.where() for imp in imps) for a, b, imps in bad)
        pytest.fail(f"{len(bad)} import(s) outside the design (which has {design}):\n{said}")


@pytest.mark.parametrize("path", TORCH_FREE)
def test_the_data_side_loads_no_torch(path):
    assert (ROOT / path).exists(), f"{path} is gone: TORCH_FREE names the data side's modules"
    project, external = project_graph()
    paths = torch_paths(path.removesuffix(".py").replace("/", "."), project, external)
    if paths:
        pytest.fail(
            f"{path} loads torch:\n" + "\n".join(f"{' -> '.join([*c, 'torch'])}: {i.where()}" for c, i in paths)
        )


def test_the_graph_holds_every_project_module_and_the_known_imports():
    project, external = project_graph()
    assert {"train_gpt2", "fineweb", "hellaswag", "bench", "support", "support.cli", "benchmarks"} <= set(project)
    assert "support.cli" in project["train_gpt2"] and "support" in project["train_gpt2"]
    assert any(imp.target == "torch" for imp in external["train_gpt2"])
    assert any(m.startswith("benchmarks.") for m in project["bench"])


def test_the_walk_on_a_project_made_here_names_its_imports_cycles_and_torch(tmp_path):
    files = {
        "train_gpt2.py": "import os\nfrom support.common import x\n",
        "hellaswag.py": "from support import common\n\ndef f():\n    import train_gpt2\n",
        "support/__init__.py": "",
        "support/common.py": "from . import sibling\n\ndef f():\n    from support.machine import g\n",
        "support/sibling.py": "import numpy as np\n",
        "support/machine.py": "import torch.nn as nn\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    project, external = import_graph(tmp_path)
    assert project["hellaswag"] == {
        "support": [Import("support", "hellaswag.py", 1, False)],
        "support.common": [Import("support.common", "hellaswag.py", 1, False)],
        "train_gpt2": [Import("train_gpt2", "hellaswag.py", 4, True)],
    }
    assert set(project["support.common"]) == {"support", "support.sibling", "support.machine"}  # relative, resolved
    assert [imp.target for imp in external["support.sibling"]] == ["numpy"]
    assert find_cycle({a: set(t) for a, t in project.items()}) is None
    ((chain, imp),) = torch_paths("hellaswag", project, external)  # the shortest chain, through a function
    assert chain == ["hellaswag", "support.common", "support.machine"]
    assert imp == Import("torch", "support/machine.py", 1, False)
    assert torch_paths("support.sibling", project, external) == []

    # a function-local import closes a cycle, and the message names where each import is
    (tmp_path / "train_gpt2.py").write_text("import os\n\ndef evaluate():\n    import hellaswag\n")
    project, _ = import_graph(tmp_path)
    cycle = find_cycle({a: set(t) for a, t in project.items()})
    assert describe_cycle(cycle, project) == (
        "hellaswag -> train_gpt2 -> hellaswag\n"
        "    hellaswag -> train_gpt2: hellaswag.py:4 (inside a function)\n"
        "    train_gpt2 -> hellaswag: train_gpt2.py:4 (inside a function)"
    )
    assert [(a, b) for a, b, _ in forbidden_imports(project)] == [("hellaswag", "train_gpt2")]
