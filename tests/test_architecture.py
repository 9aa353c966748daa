"""The package's architecture, checked: the import-linter layers, no cycles, public and private names.

`lint-imports` reads the contract in pyproject.toml (`[tool.importlinter]`): a module imports
only from its own layer and the layers below, and no package's modules import each other in
a circle. A copy of the package with one upward import shows the contract can fail.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cpcompose"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` run from `root` (its pyproject.toml, its copy of the package), no cache."""
    run = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", run], cwd=root, capture_output=True, text=True, check=False,
                          env={"PYTHONPATH": str(root), "PATH": ""})


def test_the_layer_contract_holds() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in done.stdout  # every contract pyproject.toml declares was checked


@pytest.mark.parametrize("module,imports,named", [
    ("layouts/base.py", "import cpcompose.attention.call.options",
     "cpcompose.layouts.base -> cpcompose.attention.call.options"),
    ("attention/local/blocks.py", "import cpcompose.attention.strategies.ring",  # up a room inside attention
     "cpcompose.attention.local.blocks -> cpcompose.attention.strategies.ring"),
    ("attention/local/blocks.py", "import cpcompose.attention.local.execute", ".blocks -> .execute"),  # a cycle
])
def test_the_contract_catches_an_upward_import_and_a_cycle(tmp_path: Path, module: str, imports: str,
                                                          named: str) -> None:
    shutil.copytree(PACKAGE, tmp_path / "cpcompose", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "cpcompose" / module
    target.write_text(target.read_text() + f"\n{imports}  # noqa\n")
    done = _lint(tmp_path)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout
    assert named in done.stdout  # the message names the import to remove


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _package_of(module: str) -> str:
    """`cpcompose.attention.cost.model` -> `cpcompose.attention` (the layer a module lives in)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_declares_its_public_names(path: Path) -> None:
    tree = _tree(path)
    declared = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and any(getattr(t, "id", None) == "__all__" for t in getattr(n, "targets", [getattr(n, "target", None)]))]
    assert declared, f"{path.relative_to(ROOT)} has no __all__"
    names = ast.literal_eval(declared[0].value)
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    defined |= {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not [x for x in names if x not in defined], f"{path.relative_to(ROOT)}: __all__ names what it lacks"
    assert not [x for x in names if x.startswith("_")], f"{path.relative_to(ROOT)}: __all__ exports a _private name"


def test_no_private_name_is_imported_across_packages() -> None:
    """Internal (`_name`) functions and modules stay inside their package; `_compat` is the one shared one."""
    crossings = []
    for path in MODULES:
        here = _module_name(path)
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("cpcompose"):
                continue
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                private = [p for p in target.split(".")[1:] if p.startswith("_") and p not in ("_compat", "__init__")]
                if private and _package_of(node.module) != _package_of(here):
                    crossings.append(f"{here} imports {target}")
    assert not crossings, "\n".join(crossings)


_FRESH = """
import sys
import cpcompose
print(" ".join(sorted(m for m in sys.modules if m.startswith("cpcompose"))))
"""


def test_import_cpcompose_loads_no_trainer_infrastructure() -> None:
    """The library is the CP API: FSDP, pipelining, the config, data and the trainer load only when asked for."""
    done = subprocess.run([sys.executable, "-c", _FRESH], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = done.stdout.split()
    assert "cpcompose.parallel" in loaded and "cpcompose.attention" in loaded
    trainer = ("distributed", "training", "config", "data", "models", "integrations", "train")
    assert not [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in trainer], loaded
    import cpcompose

    assert "ParallelDims" not in cpcompose.__all__
    from cpcompose.distributed import ParallelDims  # still where the trainer's infrastructure lives

    assert ParallelDims.__module__ == "cpcompose.distributed.parallel_dims"
