"""Every code block of README.md and of the docs (docs/**/*.md) that a reader could run is run here, or says why not.

The README's examples broke unnoticed (a warmup longer than the example's steps, a
script that printed nothing, snippets using names they never defined). Now each
fenced block carries a marker on the line before it (an HTML comment: invisible on
GitHub), and `test_every_block_is_run_or_says_why_not` fails for a block of a
runnable language (bash, sh, shell, console, python, py, toml) without one, so a new
block cannot slip in untested:

    <!-- readme: run NAME -->             run by `test_run_block[NAME]` (below: how)
    <!-- readme: run NAME torchrun=2 -->  a python script for `torchrun --nproc_per_node 2`
    <!-- readme: check NAME -->           exercised by the test function `check_NAME` in this file
    <!-- readme: fragment -->             python that is part of a program; its first line says so
                                          ("# Fragment: ..."), for the reader
    <!-- readme: not run: REASON -->      a complete command not run here (a pip install, the suite
                                          itself, a GPU job); REASON is required

Every other block needs a language (```text for diagrams), so that none hides as prose.

Names are unique across the README and the docs. How a `run` block runs: in one
sandbox shared by the README and the docs (a temporary folder holding links to the
repository's top-level entries, so `outputs/` lands in it), the README first, then the
docs pages in path order, as a reader who follows them would; a command, or a python
block whose text is the same as one already run (the README's example, again in the
docs), runs once. In a bash block each
command (a `\\` continues a line, `&&` chains, `#` comments) runs with a timeout and
must exit 0 without a traceback; `pip install` is not run (the suite runs installed),
but the extras it names must exist. A training command (`cpcompose.train`,
`cpcompose-train`, `cpcompose/train.py`) runs at the size `REDUCED` gives, except a
`--help` or a `--job.dry_run`. A python block runs as a script (under `torchrun` when
its marker says so) and must print something; a toml block is loaded as a config.
Every python block, fragments included, must name only what cpcompose has, with
arguments its functions take; every repository path a command names must exist. The
README stays short (at most `README_MAX_LINES` lines), shows the set-up, the fine-tuning install
and a runnable example on its first two screens, and its links lead somewhere.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README first (a reader starts there), then every docs page in path order.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250  # one screen or two of what, why, how to install and one example; the rest is in docs/
# What a newcomer must find on the README's first two screens (about 50 lines each): the set-up's two commands
# (the test command exactly as .ci/run runs it), the fine-tuning install step, and a runnable example.
FIRST_SCREENS = 100
FIRST_SCREENS_HOLD = ('pip install "torch==2.13.0" -e . && python -m cpcompose.train',
                      'pip install "torch==2.13.0" -e ".[test]" && python -m pytest', 'pip install -e ".[hf]"',
                      "<!-- readme: run quickstart")
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py", "toml"}
TRAIN_ENTRIES = {"cpcompose.train", "cpcompose-train", "cpcompose/train.py"}
# A training command runs at this size; the rest of its command line is as the README writes it.
# Each entry: the option and the value it gets (from the value written, or None when absent).
REDUCED: dict[str, Callable[[str | None], str | None]] = {
    "--training.steps": lambda v: "2",  # absent too: the configs train for hundreds of steps
    "--training.seq_len": lambda v: None if v is None else str(min(int(v), 512)),  # 16k tokens: a minute a step
    "--metrics.log_freq": lambda v: "1",  # so that the last step's line shows
}
TIMEOUT_S = 300  # a command; generous because the machine may be loaded, and a hang still fails
# What a run block's output must show, beyond exiting 0 (python blocks must print something anyway):
# a line, and the numbers it must hold. The examples compare CP with one process themselves; the
# tolerance is float32's over a few reductions in another order (measured: ~1e-7 on the losses).
EXPECT: dict[str, tuple[str, Callable[..., bool]]] = {
    "hf-training-step": (r"^loss under CP (\S+), on one process (\S+)$", lambda a, b: abs(float(a) - float(b)) < 1e-5),
    "functional": (r"^max \|CP - one-process attention\| = (\S+)$", lambda d: float(d) < 1e-5),
    "quickstart": (r"^max \|CP - one-process attention\| = (\S+)$", lambda d: float(d) < 1e-5),
    "context-parallel-style": (r"^loss under CP (\S+), on one process (\S+)$",
                               lambda a, b: abs(float(a) - float(b)) < 1e-5),
}
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- readme: (.*?) -->\s*$")
_MARKER_FORMS = re.compile(r"^(run|check) ([\w-]+)( torchrun=\d+)?$|^fragment$|^not run: \S.*$")


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: where it opens (the page, relative to the repository, and the line), its language
    and text, and its marker."""

    page: str
    line: int
    lang: str
    text: str
    marker: str | None

    @property
    def kind(self) -> str | None:
        """"run", "check", "fragment", "not run", or None (no marker)."""
        if self.marker is None:
            return None
        return "not run" if self.marker.startswith("not run:") else self.marker.split(" ")[0]

    @property
    def name(self) -> str:
        return self.marker.split(" ")[1] if self.kind in ("run", "check") else f"{self.page}:{self.line}"

    @property
    def ranks(self) -> int | None:
        found = re.search(r"torchrun=(\d+)", self.marker or "")
        return int(found.group(1)) if found else None

    def where(self) -> str:
        first = next((ln for ln in self.text.splitlines() if ln.strip()), "")
        return f"{self.page}:{self.line} ```{self.lang} {first[:70]!r}"


def parse(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of a markdown text, each with the marker on the last non-blank line before it."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = _MARKER.match(before)
        blocks.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                            marker.group(1).strip() if marker else None))
        i = end + 1
    return blocks


def problems(blocks: list[Block], checks: set[str]) -> list[str]:
    """Every block neither exercised nor explained, every malformed marker, every check without its block."""
    found, names = [], set()
    for b in blocks:
        if not b.lang:
            found.append(f"{b.where()}: a fence without a language (```text for a diagram, or a marker)")
        elif b.marker is None and b.lang in RUNNABLE:
            found.append(f"{b.where()}: neither run nor explained: put '<!-- readme: run NAME -->', "
                         "'<!-- readme: fragment -->' or '<!-- readme: not run: REASON -->' on the line before it")
        elif b.marker is not None and not _MARKER_FORMS.match(b.marker):
            found.append(f"{b.where()}: unknown marker {b.marker!r} (tests/test_readme.py's docstring lists them)")
        elif b.marker is not None and b.lang not in RUNNABLE:
            found.append(f"{b.where()}: a marker on a ```{b.lang} block, which nothing would run")
        elif b.kind == "fragment" and (b.lang not in ("python", "py") or not b.text.startswith("# Fragment: ")):
            found.append(f"{b.where()}: a fragment is python whose first line tells the reader ('# Fragment: ...')")
        elif b.kind == "check" and b.name not in checks:
            found.append(f"{b.where()}: no function check_{b.name.replace('-', '_')} in tests/test_readme.py")
        if b.kind in ("run", "check"):
            if b.name in names:
                found.append(f"{b.where()}: the name {b.name!r} is used twice")
            names.add(b.name)
    found += [f"check_{c.replace('-', '_')} in tests/test_readme.py checks no README or docs block"
              for c in sorted(checks - {b.name for b in blocks if b.kind == "check"})]
    return found


def _checks() -> dict[str, Callable[[Block], None]]:
    return {name[len("check_"):].replace("_", "-"): fn for name, fn in globals().items()
            if name.startswith("check_") and callable(fn)}


BLOCKS = [b for page in PAGES for b in parse(page.read_text(), str(page.relative_to(ROOT)))]


def test_every_block_is_run_or_says_why_not() -> None:
    found = problems(BLOCKS, set(_checks()))
    assert not found, "README and docs blocks:\n" + "\n".join(found)


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    """A newcomer reads the README's first screens: it stays short, and every local link in it exists (the docs
    build checks the docs' own links)."""
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md: {len(text.splitlines())} lines; move detail to docs/"
    first = "\n".join(text.splitlines()[:FIRST_SCREENS])
    assert not [w for w in FIRST_SCREENS_HOLD if w not in first], f"not in the README's first {FIRST_SCREENS} lines"
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install --quiet ", "pip install ")  # CI's output: quiet
    assert FIRST_SCREENS_HOLD[1] in ci, "the README's test command is no longer what .ci/run runs"
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^(https?:|#)", t)]
    assert targets, "the README links nowhere into the docs"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to what the repository lacks: {missing}"


def test_the_audit_catches_an_unmarked_block_and_a_stray_check() -> None:
    """The audit itself can fail: a new unmarked block, a bad marker, an unlabelled fragment, a stray check."""
    text = ("Intro.\n\n```bash\npython -m cpcompose.train\n```\n\n<!-- readme: frag -->\n```python\nx = 1\n```\n"
            "<!-- readme: fragment -->\n```python\nx = 1\n```\n```\nA -> B\n```\n"
            "<!-- readme: run a -->\n```bash\ntrue\n```\n<!-- readme: run a -->\n```toml\n```\n")
    found = problems(parse(text), {"gone"})
    expected = ["neither run nor explained", "unknown marker 'frag'", "a fragment is python whose first line",
                "a fence without a language", "the name 'a' is used twice", "check_gone"]
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found)), found


# --- what every block must get right, run or not ---


def _commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, `&&` chains split."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(words[:cut])
            words = words[cut + 1:]
    return commands


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("bash", "sh", "shell", "console")],
                         ids=lambda b: b.name)
def test_commands_name_files_and_extras_that_exist(block: Block) -> None:
    missing = []
    for words in _commands(block.text):
        for word in words:
            path = re.match(r"^(?:--[\w.]+=)?((?:train_configs|scripts|cpcompose|docs|tests)/[\w./-]+)$", word)
            if path and not (ROOT / path.group(1)).exists():
                missing.append(f"the file {path.group(1)}")
            extras = re.match(r"^\.\[([\w,-]+)\]$", word)
            if words[:2] == ["pip", "install"] and extras:
                missing += [f"the extra [{e}]" for e in extras.group(1).split(",") if e not in _extras()]
    assert not missing, f"{block.where()} names what the repository lacks: {missing}"


def _cpcompose_objects(tree: ast.AST) -> dict[str, object]:
    """What a block's names mean in cpcompose: its imports, and the package's public names."""
    import cpcompose

    names: dict[str, object] = {n: getattr(cpcompose, n) for n in cpcompose.__all__}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cpcompose":
            module = importlib.import_module(node.module)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(module, alias.name, None)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cpcompose":
                    names[alias.asname or alias.name] = importlib.import_module(alias.name)
    return names


def _bad_calls(tree: ast.AST, names: dict[str, object]) -> list[str]:
    """Calls of cpcompose callables whose arguments their signatures do not take."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        target = names.get(func.id) if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = getattr(names.get(func.value.id), func.attr, None) if func.value.id in names else None
        unpacked = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        if target is None or not callable(target) or unpacked:
            continue
        try:
            inspect.signature(target).bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as e:
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...): {e}")
        except ValueError:  # no signature to read (a builtin)
            pass
    return found


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "py")], ids=lambda b: b.name)
def test_python_names_what_cpcompose_has(block: Block) -> None:
    tree = ast.parse(block.text, filename=block.where())
    names = _cpcompose_objects(tree)
    missing = [name for name, obj in names.items() if obj is None]
    assert not missing, f"{block.where()} imports what cpcompose does not have: {missing}"
    bad = _bad_calls(tree, names)
    assert not bad, f"{block.where()} calls cpcompose with arguments it does not take:\n" + "\n".join(bad)


# --- running the run blocks ---


@dataclass
class Sandbox:
    """Where the README's commands run, and the commands already run (a command repeated in the README runs once)."""

    folder: Path
    env: dict[str, str]
    done: set[tuple[str, ...]]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    folder = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "outputs", "__pycache__", ".pytest_cache"):
            (folder / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PET_STANDALONE": "1"}  # torchrun: a free port, not 29500
    env.pop("CPCOMPOSE_FAULT", None)
    yield Sandbox(folder, env, set())


def _reduced(words: list[str]) -> list[str]:
    """A training command at the `REDUCED` size (options written `--key=value` or `--key value`)."""
    out, i, seen = [], 0, {}
    while i < len(words):
        key, eq, value = words[i].partition("=")
        if key in REDUCED:
            if not eq and i + 1 < len(words):
                value, i = words[i + 1], i + 1
            seen[key] = value
        else:
            out.append(words[i])
        i += 1
    for key, size in REDUCED.items():
        if (value := size(seen.get(key))) is not None:
            out.append(f"{key}={value}")
    return out


def _run(words: list[str], box: Sandbox, what: str) -> str:
    env_words = [w for w in words[: next((i for i, w in enumerate(words) if "=" not in w), len(words))]]
    env = {**box.env, **dict(w.split("=", 1) for w in env_words)}
    command = words[len(env_words):]
    try:
        done = subprocess.run(command, cwd=box.folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what}: {shlex.join(words)} ran past {TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}") from None
    shown = f"{what}: {shlex.join(words)} (in {box.folder})\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    assert done.returncode == 0, f"exit code {done.returncode}\n{shown}"
    assert "Traceback" not in done.stderr, shown
    return done.stdout


def _run_shell(block: Block, box: Sandbox) -> None:
    for words in _commands(block.text):
        if words[:2] == ["pip", "install"]:
            continue  # the suite runs installed; test_commands_name_files_and_extras_that_exist checks the extras
        trains = bool(TRAIN_ENTRIES & set(words)) and not {"--help", "-h", "--job.dry_run"} & set(words)
        words = _reduced(words) if trains else words
        if tuple(words) in box.done:
            continue
        out = _run(words, box, block.where())
        box.done.add(tuple(words))
        if trains:
            assert re.search(r"^\S+ done: 2 steps", out, re.M) or "nothing to train" in out, out[-3000:]
        elif "--job.dry_run" in words:
            assert out.startswith("plan for "), out
        elif "--help" in words:
            assert out.startswith("usage: "), out[:500]


def _run_python(block: Block, box: Sandbox) -> None:
    if (block.text,) in box.done:
        return  # the same program, already run from an earlier page
    script = box.folder / f"readme_{block.name.replace('-', '_')}.py"
    script.write_text(block.text)
    launcher = ["torchrun", f"--nproc_per_node={block.ranks}"] if block.ranks else [sys.executable]
    out = _run([*launcher, script.name], box, block.where())
    assert out.strip(), f"{block.where()} printed nothing"
    pattern, holds = EXPECT[block.name]  # every python run block says what it must print
    found = re.search(pattern, out, re.M)
    assert found and holds(*found.groups()), f"{block.where()} printed:\n{out}"
    box.done.add((block.text,))


def _run_toml(block: Block, box: Sandbox) -> None:
    from cpcompose.config import load_config
    from cpcompose.training.resolve import resolve_config

    path = box.folder / f"readme_{block.name.replace('-', '_')}.toml"
    path.write_text(block.text)
    resolve_config(load_config(["--config", str(path)]))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run"], ids=lambda b: b.name)
def test_run_block(block: Block, sandbox: Sandbox) -> None:
    if block.lang in ("python", "py"):
        _run_python(block, sandbox)
    elif block.lang == "toml":
        _run_toml(block, sandbox)
    else:
        _run_shell(block, sandbox)


# --- the blocks checked by a function of their own (`<!-- readme: check NAME -->`) ---


def check_torchtitan_launch(block: Block) -> None:
    """torchtitan's trainer cannot run on CPU (docs: "Awaits a GPU"): its own ConfigManager parses the command."""
    from tests.support import torchtitan_stub

    torchtitan_stub.install()  # before torchtitan is imported: see the stand-in's docstring
    from torchtitan.config import ConfigManager

    from cpcompose.integrations.torchtitan import CPComposeTrainer

    (words,) = _commands(block.text)
    args = words[words.index("torchtitan.train") + 1:]
    config = ConfigManager().parse_args(args)
    assert isinstance(config, CPComposeTrainer.Config), type(config)
    degree = int(args[args.index("--parallelism.context_parallel_degree") + 1])
    assert config.parallelism.context_parallel_degree == degree
    assert config.cpcompose.strategy == args[args.index("--cpcompose.strategy") + 1]


def check_your_data(block: Block) -> None:
    """The `[data]` example (with its tokenizer line filled in) passes the pre-launch check on chat records,
    and its page's example of a bad record is, word for word, the line that check prints."""
    from cpcompose.config import ConfigError, load_config
    from cpcompose.training.launcher.preflight import preflight
    from tests.support.hf_data import chat_records, tiny_tokenizer_folder, write_jsonl

    said = re.search(r"`config error: (data\.path: data/conversations\.jsonl:(\d+): messages\[(\d+)\]\.role is "
                     r"'(\w+)', [^`]+)`", (ROOT / block.page).read_text())
    assert said, f"{block.page}'s example of a bad record moved: update check_your_data"
    line, index, role = int(said.group(2)), int(said.group(3)), said.group(4)
    folder = Path(tempfile.mkdtemp(prefix="cpcompose-readme-data-"))
    text = block.text.replace('# tokenizer = "models/tiny-llama"', f'tokenizer = "{tiny_tokenizer_folder()}"')
    assert text != block.text, block.text
    (folder / "data.toml").write_text(text)
    (folder / "data").mkdir()
    records = chat_records(line)
    argv = ["--config", "data.toml", "--job.dump_folder=out", "--model.vocab_size=320", "--training.seq_len=256"]
    with contextlib.chdir(folder):
        write_jsonl(Path("data/conversations.jsonl"), records)
        assert preflight(load_config(argv), 1) is None
        records[line - 1]["messages"][index]["role"] = role
        write_jsonl(Path("data/conversations.jsonl"), records)
        with pytest.raises(ConfigError) as refused:
            preflight(load_config(argv), 1)
    assert str(refused.value) == said.group(1), str(refused.value)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "check"], ids=lambda b: b.name)
def test_check_block(block: Block) -> None:
    _checks()[block.name](block)
