"""Reading a :class:`JobConfig`: TOML file, command-line overrides, type conversion, ``--help``.

Precedence, later wins: dataclass defaults < ``--config FILE.toml`` < ``--section.key=value``.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import json
import math
import sys
import textwrap
import tomllib  # Python >= 3.11, as pyproject requires
import types
from dataclasses import MISSING, fields, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from cpcompose.config.job_config import JobConfig
from cpcompose.config.sections import ConfigError, require, source_table


__all__ = ["format_help", "load_config"]


def _sections() -> dict[str, type]:
    return get_type_hints(JobConfig)


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under it, read from the class source as torchtitan does."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return f"tuple[{', '.join(map(_type_name, args))}]"
    return tp.__name__


def _show(value: Any) -> str:
    return "none" if value is None else json.dumps(value)


def format_help() -> str:
    """Every option grouped by section, with its type, default and field docstring."""
    lines = ["usage: [--config FILE.toml] [--section.key=VALUE | --section.key VALUE ...]",
             "precedence: command line > TOML file > the defaults below", ""]
    for name, cls in _sections().items():
        lines.append(f"[{name}]  {inspect.getdoc(cls)}")
        docs, hints = _field_docs(cls), get_type_hints(cls)
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            lines.append(f"  --{name}.{f.name}  ({_type_name(hints[f.name])}, default: {_show(default)})")
            lines += textwrap.wrap(docs.get(f.name, ""), 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
        lines.append("")
    return "\n".join(lines)


_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def _convert(key: str, value: Any, tp: Any, *, from_text: bool = True) -> Any:
    """Coerce a command-line string (``from_text``) or a TOML value to the annotated type ``tp``.

    A TOML value must already have the type: ``seq_len = "1024"`` is refused, since a
    quoted number is more often a mistake than a wish. Floats must be finite.
    """
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        require(value in args, key, f"{value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(key, value, inner, from_text=from_text)
    if origin is tuple:
        items = value.strip(" ()[]").split(",") if isinstance(value, str) else value
        require(isinstance(items, (list, tuple)) and len(items) == len(args), key,
                 f"expected {len(args)} comma-separated values, got {value!r}")
        return tuple(_convert(key, v, a, from_text=isinstance(value, str)) for v, a in zip(items, args))
    if tp in (dict, list) and isinstance(value, str) and from_text:  # a table or array on the command line: JSON
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{key}: expected a JSON object such as '{{\"rope_type\": \"yarn\"}}', "
                              f"got {value!r} ({e})") from None
    if isinstance(value, str) and tp is not str and from_text:
        text = value.strip().lower()
        try:
            value = _BOOLS[text] if tp is bool else tp(text)
        except (KeyError, ValueError):
            pass
    ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    require(ok, key, f"expected {'bool (true/false/1/0)' if tp is bool else _type_name(tp)}, got {value!r}"
            + (" (a quoted string in the TOML file)" if isinstance(value, str) and not from_text else ""))
    if tp is float:
        require(math.isfinite(value), key, f"must be a finite number, got {value!r}")
    return value


# Names other trainers use for a key, so that their users are pointed at ours (leaf names only).
_ALIASES = {
    "learning_rate": "optimizer.lr", "max_steps": "training.steps", "warmup": "lr_scheduler.warmup_steps",
    "seq_length": "training.seq_len", "max_seq_len": "training.seq_len", "context_parallel_degree": "parallelism.cp",
    "context_parallel": "parallelism.cp", "global_batch_size": "training.batch_size", "dp": "parallelism.dp_shard",
    "expert_parallel_degree": "parallelism.ep", "expert_parallel": "parallelism.ep",
}


# What other trainers' users look for and this trainer does not have (leaf names only): said instead of a near
# spelling of something else (`parallelism.ep` is not `optimizer.eps`).
_NOT_HERE = dict.fromkeys(
    ("etp", "expert_tensor_parallel_degree"),
    "experts are not split by tensor parallelism: parallelism.ep deals them to ranks, FSDP2 shards each one",
)


def _candidates(name: str, known: list[str]) -> list[str]:
    """The keys a mistyped `name` most likely meant, searched in every section.

    The key name decides, its section only breaks ties: the same name in another
    section (`training.lr` -> `optimizer.lr`: the user knew the name, not its section),
    then another trainer's name for it (`learning_rate`), then the closest spelling of
    the name in any section (`training.seqlen` -> `training.seq_len`, `training.warmup`
    -> `lr_scheduler.warmup_steps`); a name of three letters or fewer is only looked for in
    its own section (two letters are a third of a word away from many others).
    """
    section, _, leaf = name.rpartition(".")

    def near(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    def rank(keys: list[str]) -> list[str]:
        return sorted(keys, key=lambda k: -near(section, k.rpartition(".")[0]))

    same = [k for k in known if k.rpartition(".")[2] == leaf]
    if same:  # several sections may have it (`name`)
        return rank(same)[:3]
    if _ALIASES.get(leaf) in known:
        return [_ALIASES[leaf]]
    scored = [(near(leaf, k.rpartition(".")[2]), k) for k in known
              if len(leaf) > 3 or not section or k.rpartition(".")[0] == section]
    best = max((score for score, _ in scored), default=0.0)
    return rank([k for score, k in scored if score == best])[:1] if best >= 0.6 else []


def _suggest(name: str, known: list[str], prefix: str = "") -> str:
    missing = _NOT_HERE.get(name.rpartition(".")[2])
    if missing is not None:
        return f": {missing}"
    matches = _candidates(name, known)
    if not matches:
        return ""
    return " (did you mean " + " or ".join(f"'{prefix}{m}'" for m in matches) + "?)"


def _parse_argv(argv: list[str], known: dict[str, Any]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into the --config path and (key, raw string) overrides, in order."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        require(arg.startswith("--"), arg, "unexpected argument; options look like --section.key=value")
        name, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            elif known.get(name) is bool:  # a bare --job.dry_run means true
                value = "true"
            else:
                raise ConfigError(f"{name}: missing value after --{name}")
        if name == "config":
            config_path = value
        elif name not in known:
            raise ConfigError(f"unknown option '--{name}'{_suggest(name, list(known), '--')}")
        else:
            overrides.append((name, value))
    return config_path, overrides


def _read_toml(path: str, known: dict[str, Any]) -> list[tuple[str, Any]]:
    """(key, value) pairs of a TOML file whose tables and keys are all known."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {path} is not valid TOML: {e}") from None
    sections = sorted({key.split(".")[0] for key in known})
    pairs = []
    for section, entries in table.items():
        if section not in sections:
            raise ConfigError(f"unknown section '[{section}]' in {path}{_suggest(section, sections)}")
        require(isinstance(entries, dict), section, f"must be a [{section}] table in {path}")
        for key, value in entries.items():
            full = f"{section}.{key}"
            if full not in known:
                raise ConfigError(f"unknown key '{full}' in {path}{_suggest(full, list(known))}")
            pairs.append((full, value))
    return pairs


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from ``--config FILE.toml`` and ``--section.key[=]value`` overrides.

    Args:
        argv: command-line arguments without the program name; ``None`` reads ``sys.argv[1:]``.
    Returns:
        The config, already checked by :meth:`JobConfig.validate` without a world size (what needs the model's
        family or files, the trainer's resolution step checks: `cpcompose.training.resolve.resolve_config`).
    Raises:
        ConfigError: an unknown section or key, a malformed value or an inconsistent combination.
        SystemExit: with code 0 after printing :func:`format_help` for ``-h`` / ``--help``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(format_help())
        raise SystemExit(0)
    sections = _sections()
    known = {f"{s}.{k}": tp for s, cls in sections.items() for k, tp in get_type_hints(cls).items()}
    config_path, overrides = _parse_argv(argv, known)
    from_file = _read_toml(config_path, known) if config_path is not None else []
    values: dict[str, dict[str, Any]] = {s: {} for s in sections}
    sourced = [(k, v, False) for k, v in from_file] + [(k, v, True) for k, v in overrides]
    for key, value, from_text in sourced:  # the command line comes last, so it wins
        section, name = key.split(".", 1)
        values[section][name] = _convert(key, value, known[key], from_text=from_text)
    config = _with_derived_defaults(JobConfig(**{s: cls(**values[s]) for s, cls in sections.items()}))
    config.validate()
    return config


def _with_derived_defaults(config: JobConfig) -> JobConfig:
    """The defaults that depend on other values, filled once so every reader sees one answer: `data.pack` a bool
    (`Data.packed`) and each [[data.sources]] table completed with its defaults. Pure: no file is read."""
    d = config.data
    data = replace(d, pack=d.packed(), sources=[source_table(i, entry) for i, entry in enumerate(d.sources)])
    return replace(config, data=data)
