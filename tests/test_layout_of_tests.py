"""The suite's own layout: folders that mirror the package, and no test module importing another.

A test module imports the library, third-party packages and `tests.support.*` only:
what two test modules share lives in `tests/support/`, and nothing imports
`tests.conftest` (pytest loads it). Imports are read with `ast` from every module
under tests/ (support modules and conftest included, imports inside functions too),
and so are the import lines of child-interpreter snippets held in string constants.
Every folder is a package (rank-pool workers unpickle a case by its module's path),
and every folder but support/ is named after a subpackage or module of `cpcompose`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "cpcompose"
ALLOWED = "tests.support"
# An import line inside a string (a `python -c` snippet run in a child interpreter).
_SNIPPET_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w., ]+))", re.MULTILINE)


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The module paths an import statement names (for `from a import b`, both `a` and `a.b`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def _snippet_imports(node: ast.AST) -> list[str]:
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return []
    out = []
    for frm, names, plain in _SNIPPET_IMPORT.findall(node.value):
        if frm:
            out += [frm] + [f"{frm}.{n.strip()}" for n in names.split(",") if n.strip()]
        else:
            out += [n.strip().split(" as ")[0] for n in plain.split(",") if n.strip()]
    return out


def _allowed(name: str) -> bool:
    top = name.split(".")[0]
    return top != "tests" or name == "tests" or name == ALLOWED or name.startswith(ALLOWED + ".")


def forbidden_imports(root: Path) -> list[str]:
    """`file:line: module` for every import of a `tests` module other than `tests.support.*` under `root`."""
    found = []
    for path in _modules(root):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = _imported(node, module, path.name == "__init__.py") + _snippet_imports(node)
            bad = [name for name in names if not _allowed(name)]
            if bad:  # one line per statement (or snippet): the module it names
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {bad[0]}")
    return found


def test_no_test_module_imports_another() -> None:
    found = forbidden_imports(TESTS)
    assert not found, "import only tests.support.* from tests (move shared helpers there):\n" + "\n".join(found)


# `{T}` stands for `tests`: written out, these lines would be imports of test modules in this very file.
BAD = {
    "from-test-module": "from {T}.attention.test_parity import assert_matches_single_process\n",
    "import-test-module": "import {T}.training.test_trainer\n",
    "from-folder": "from {T}.training import test_trainer\n",
    "conftest": "from {T} import conftest\n",
    "from-conftest": "from {T}.conftest import NO_CUDA\n",
    "relative-in-function": "def case(mesh):\n    from ..parallel.test_entry_points import make_model\n",
    "relative-sibling": "from . import test_other\n",
    "child-snippet": 'SNIPPET = """\nimport sys\nfrom {T}.layouts.test_layouts import CASES\n"""\n',
}


@pytest.mark.parametrize("source", list(BAD.values()), ids=list(BAD))
def test_the_check_catches_an_import_of_a_test_module(tmp_path: Path, source: str) -> None:
    root = tmp_path / "tests"
    for folder in (root, root / "support", root / "attention"):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (root / "support" / "cases.py").write_text("from tests.support import other\nimport torch\n")
    good = "from tests.support.cases import x\nfrom tests.support import cases\nimport tests.support.cases\n"
    (root / "attention" / "test_good.py").write_text(good + "from .. import support\n")
    assert forbidden_imports(root) == []
    (root / "attention" / "test_bad.py").write_text(good + source.replace("{T}", "tests"))
    assert [line.split(":")[0] for line in forbidden_imports(root)] == ["tests/attention/test_bad.py"]


def test_every_folder_is_a_package() -> None:
    folders = {p.parent for p in _modules(TESTS)}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"folders without __init__.py (workers import cases by module path): {missing}"


def test_folders_mirror_the_package() -> None:
    mirrored = {p.stem for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    folders = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__")
    strays = [name for name in folders if name != "support" and name not in mirrored]
    assert "support" in folders
    assert not strays, f"tests/ folders that name nothing in cpcompose/: {strays}"
    loose = sorted(p.name for p in (TESTS / "support").glob("test_*.py"))
    assert not loose, f"tests/support/ holds helpers, not tests: {loose}"
