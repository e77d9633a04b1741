"""trainloop's modules import one another without a circle (issue 24): every `import` and
`from ... import` statement counts, function-local ones included, because a circle hidden in a
function is still two modules that each need the other. A package's own __init__ may gather its
submodules; a submodule names its siblings by their module path, not through the package. Above the
modules, the packages are layers (issue 59): import-linter's contract in pyproject.toml, run here, and
each strategy's section and each objective's name read only in its own package."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "trainloop"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """trainloop module -> the trainloop modules its statements import (anywhere in the file)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if node.level == 0 else None
                assert base is not None, f"{path}: relative import; name the module in full"
                # `from trainloop import dcp` imports the module trainloop.parallel.dcp; `from x import f` imports x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (a list of modules that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_is_read_whole():
    graph = import_graph()
    assert "trainloop.run" in graph and "trainloop.config.compose" in graph["trainloop.run"]
    assert "trainloop.errors" in graph["trainloop.config.compose"]  # a top-level import
    assert "trainloop.parallel.deepspeed_config" in graph["trainloop.parallel.zero"]  # a function-local one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_of_trainloop_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_errors_imports_nothing_from_trainloop():
    assert import_graph()["trainloop.errors"] == set()


def test_checking_a_config_loads_neither_torch_nor_numpy():
    """A refused config is said in a fraction of a second: composing and validating reads the tables
    (optimizers, data formats, objectives, strategies) without loading what they build with."""
    import subprocess
    import sys

    code = ("import sys\nfrom trainloop.config.compose import compose_config\ncompose_config(['+preset=smoke'])\n"
            "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'datasets') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_root_holds_the_main_path_and_the_commands():
    """trainloop/'s root is the main path (entry, run, build, loop and step, guard, export, errors, the
    run's lifetime) and the command modules users type, each a thin entry point into its package;
    everything else sits in a package named for its concern (issue 34)."""
    commands = {"__main__", "plan", "doctor", "prepare", "reference", "report", "sweep", "verify_resume",
                "deepspeed"}
    root = {path.stem for path in PACKAGE.glob("*.py")}
    assert commands <= root
    assert len(root - commands) <= 15, sorted(root - commands)
    for name in commands - {"__main__"}:
        entry = (PACKAGE / f"{name}.py").read_text()
        assert len(entry.splitlines()) <= 12 and 'if __name__ == "__main__":' in entry, name
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert {"config", "data", "model", "objectives", "optim", "parallel", "checkpoint", "memory", "observe",
            "tools"} <= packages


STRATEGY_SECTIONS = {"parallel", "deepspeed", "fsdp"}


def config_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each read of a strategy's section off a config (`cfg.parallel`, `self.cfg.deepspeed`,
    `config.fsdp`) and each comparison of an objective's name (`cfg.objective.name == ...`) in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in STRATEGY_SECTIONS:
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if owner in ("cfg", "config"):
                found.append((node.lineno, f"{owner}.{node.attr}"))
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if (isinstance(side, ast.Attribute) and side.attr == "name" and isinstance(side.value, ast.Attribute)
                        and side.value.attr == "objective"):
                    found.append((node.lineno, "objective.name compared"))
    return sorted(found)


def test_the_reader_finds_both_kinds_of_leak():
    code = ("a = cfg.parallel.tp_size\nb = self.cfg.deepspeed.stage\nif cfg.objective.name == 'dpo': pass\n"
            "c = cfg.model.name\nd = OBJECTIVES[cfg.objective.name].head\n")
    assert config_reads(ast.parse(code)) == [(1, "cfg.parallel"), (2, "cfg.deepspeed"), (3, "objective.name compared")]


def test_strategy_keys_and_objective_names_are_read_in_their_own_packages():
    """Issue 59: outside trainloop/parallel/ (and the config's composition, trainloop/config/) nothing reads
    cfg.parallel, cfg.deepspeed or cfg.fsdp: it asks trainloop.parallel (splits, context_size, shards_weights,
    forwards_together, ...); outside trainloop/objectives/ no objective's name is compared: its row declares
    what it needs (Objective.needs, head, copies_model)."""
    leaks = []
    for path in sorted(PACKAGE.rglob("*.py")):
        package = path.relative_to(PACKAGE).parts[0]
        for line, what in config_reads(ast.parse(path.read_text(), str(path))):
            allowed = ("objectives",) if what.startswith("objective") else ("parallel", "config")
            if package not in allowed:
                leaks.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not leaks, "\n".join(leaks)


def test_no_objective_row_imports_another_row():
    """Issue 59, item 5: what rows share (the frozen reference, sampling, the pairs' sums) lives in modules of its
    own (objectives/reference.py, generation.py, pairs.py), so that a row is one file that imports no other row."""
    from trainloop.objectives import OBJECTIVES

    rows = {row.__module__ for row in OBJECTIVES.values()}
    graph = import_graph()
    assert len(rows) == len(OBJECTIVES) and rows <= set(graph)
    crossed = {row: sorted(graph[row] & rows) for row in sorted(rows) if graph[row] & rows}
    assert not crossed, crossed


def lint_imports(root: Path):
    """import-linter's contracts (pyproject.toml's [tool.importlinter]) over the package under `root`."""
    import os
    import shutil
    import subprocess
    import sys

    tool = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert tool is not None, "import-linter is not installed: it is in the test extra (scripts/setup.sh)"
    return subprocess.run([tool, "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_the_packages_keep_their_layers():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "packages are layers KEPT" in done.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path):
    """The contract is read, and can fail: a copy of trainloop whose model package imports from tools (the top
    layer) inside a function, as the package's own lazy imports do, is refused, naming the import."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "trainloop", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "trainloop" / "model" / "tensors.py", "a") as f:
        f.write("\n\ndef upward():\n    from trainloop.tools import plan  # noqa: F401\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "trainloop.model is not allowed to import trainloop.tools" in done.stdout
    assert "trainloop.model.tensors -> trainloop.tools.plan" in done.stdout
