"""Every collective cpcompose runs goes through `cpcompose.comm`: a check of the package's source.

`cpcompose.comm` promises that every byte goes through it: its waits are bounded,
its meter counts, and the order of the collectives is one every rank shares. A
direct torch.distributed collective elsewhere breaks that silently, so every module
is read with `ast` and any use of one outside `cpcompose/comm/` and `_compat.py`
(the version shims comm itself calls) fails, named by file and line: a call or a
reference (`dist.isend` handed to `P2POp`), under any alias (`import torch.distributed
as dist`, `from torch import distributed`, `torch.distributed.x`, the c10d module),
a collective imported by name, and any use of the functional collectives.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cpcompose"
ALLOWED = ("comm", "comm.py", "_compat.py")  # first path parts: comm (a package or a module) and its shims

COLLECTIVES = frozenset({
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "all_reduce", "all_reduce_coalesced", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv",
    "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "send", "send_object_list",
})
NAMESPACES = ("torch.distributed", "torch.distributed.distributed_c10d")  # where the collectives are defined
FUNCTIONAL = "torch.distributed._functional_collectives"  # every name in it is a collective (or waits on one)


def _is_collective(dotted: str) -> bool:
    if dotted == FUNCTIONAL or dotted.startswith(FUNCTIONAL + "."):
        return True
    namespace, _, name = dotted.rpartition(".")
    return namespace in NAMESPACES and name in COLLECTIVES


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Each name an import binds (anywhere in the module) -> the dotted path it stands for."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:  # `import torch.distributed` binds `torch`
                    top = alias.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """`a.b.c` with `a` resolved through the module's imports, or None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id], *reversed(parts)])


def direct_collectives(root: Path) -> list[str]:
    """`file:line: what` for every torch.distributed collective used under `root` outside comm and _compat."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or rel.parts[0] in ALLOWED:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        bound = _aliases(tree)
        lines: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                hits = [f"{node.module}.{a.name}" for a in node.names if _is_collective(f"{node.module}.{a.name}")]
                if _is_collective(node.module):
                    hits.append(node.module)
            elif isinstance(node, ast.Import):
                hits = [a.name for a in node.names if _is_collective(a.name)]
            elif isinstance(node, (ast.Attribute, ast.Name)):
                dotted = _dotted(node, bound)
                hits = [dotted] if dotted and _is_collective(dotted) and not isinstance(node.ctx, ast.Store) else []
            else:
                hits = []
            if hits:
                lines.setdefault(node.lineno, hits[0])
        found += [f"{root.name}/{rel}:{line}: {what}" for line, what in sorted(lines.items())]
    return found


def test_every_collective_goes_through_comm() -> None:
    found = direct_collectives(PACKAGE)
    assert not found, (
        "direct torch.distributed collectives outside cpcompose/comm/ (use the cpcompose.comm function instead: "
        "all_reduce, all_gather_tensors, all_gather_objects, broadcast, broadcast_object, barrier, all_gather, "
        "all_to_all_pieces, RingComm, fetch_rows, ...; add one there if none fits):\n  " + "\n  ".join(found)
    )


BAD = {
    "alias-call": "import torch.distributed as dist\ndef f(x):\n    dist.all_reduce(x)\n",
    "full-path": "import torch\ndef f(x):\n    torch.distributed.broadcast(x, src=0)\n",
    "from-torch": "from torch import distributed as d\ndef f():\n    d.barrier()\n",
    "by-name": "from torch.distributed import all_gather_object as gather\n",
    "reference": "import torch.distributed as dist\nOPS = (dist.isend, dist.irecv)\n",
    "c10d": "from torch.distributed import distributed_c10d as c10d\ndef f(x):\n    c10d.all_to_all_single(x, x)\n",
    "functional-module": "import torch.distributed._functional_collectives as funcol\n",
    "functional-name": "from torch.distributed._functional_collectives import all_reduce\n",
    "functional-from": "from torch.distributed import _functional_collectives\n",
    "in-function": "def f(x):\n    import torch.distributed as dist\n    dist.all_reduce(x)\n",
}
GOOD = (
    "import torch.distributed as dist\nfrom torch.distributed.device_mesh import DeviceMesh\n"
    "def f(g: dist.ProcessGroup) -> int:\n    return dist.get_rank(g) if dist.is_initialized() else 0\n"
)


@pytest.mark.parametrize("source", list(BAD.values()), ids=list(BAD))
def test_the_check_catches_a_direct_collective(tmp_path: Path, source: str) -> None:
    root = tmp_path / "cpcompose"
    (root / "comm").mkdir(parents=True)
    (root / "comm" / "ring.py").write_text(source)  # comm itself may
    (root / "_compat.py").write_text(source)  # and so may the shims
    (root / "good.py").write_text(GOOD)
    assert direct_collectives(root) == []
    (root / "parallel").mkdir()
    (root / "parallel" / "bad.py").write_text(GOOD + source)
    found = direct_collectives(root)
    assert found and all(line.startswith("cpcompose/parallel/bad.py:") for line in found), found
