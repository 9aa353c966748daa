"""Hugging Face checkpoints straight into and out of a sharded model: no full copy on any rank.

A model built on the meta device and sharded (FSDP2) holds only its own slice of every weight.
`load_pretrained_weights` reads each slice from the folder's safetensors files with
`torch.distributed.checkpoint` and its `HuggingFaceStorageReader`, which reads only the bytes of
the slices asked for; `save_pretrained_weights` writes the slices back with the
`HuggingFaceStorageWriter` and consolidates them into ordinary safetensors files.

Most families' tensors are stored under their parameter names. What differs is planned first
(`weight_plan`, from the safetensors headers and the model, reading no weights):
- tied weights (an output layer sharing the embedding): stored once, loaded once;
- transformers 5 stacks the experts of its MoE models into one tensor per layer
  (`experts.gate_up_proj` of shape `(experts, 2 x inter, hidden)`), while checkpoints keep one
  tensor per expert and projection (`experts.{e}.gate_proj.weight`, ...): the plan follows
  transformers' own conversion mapping for the layouts it can invert (experts merged along dim 0,
  then optionally concatenated along dim 1, and plain renamings). FSDP shards the stacked tensor
  along its expert dim, so each rank reads and writes its own experts' tensors only;
- a few fuse tensors stored apart into one (OLMo-Hybrid's and Kimi-Linear's q/k/v short convs,
  Qwen4-Exp's numbered n-gram shards, concatenated along dim 0) or split one stored tensor into
  several (LaraMini's `in_proj`): each rank reads the rows of its shard from the stored tensors;
- renamings are undone in turn (Bailing's `.attention.` -> `.self_attn.` -> `.self_attn.forget_gate.`),
  including those transformers writes as regexes (escaped dots, a `^` anchor);
- anything else that is not stored under the model's name is an error naming the tensors.

Non-persistent buffers (RoPE's `inv_freq`, Gemma's `embed_scale`) are in no checkpoint, and
`to_empty` leaves them uninitialised: `init_non_persistent_buffers` recomputes them with the
model's own `_init_weights`, as transformers does after loading, and checks none is left unset.
"""

from __future__ import annotations

import copy
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

try:
    from safetensors import safe_open
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers import initialization as hf_init
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, Split, WeightConverter, WeightRenaming
except ImportError as e:  # an optional dependency: say which extra brings it
    raise ImportError(f"cpcompose.integrations.transformers needs transformers>=5 (pip install 'cpcompose[hf]'): {e}") \
        from e

__all__ = [
    "StoredTensor", "WeightPlan", "copy_model_files", "export_pretrained", "init_non_persistent_buffers",
    "load_pretrained_weights", "read_checkpoint_index", "save_pretrained_weights", "weight_plan",
]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_INDEX = "model.safetensors.index.json"
_LITERAL = re.compile(r"^[A-Za-z0-9_.]+$")  # a pattern with no regex syntax: renamed by plain replacement


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint folder, from its file's header."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str
    """The safetensors file's name in the folder."""


def read_checkpoint_index(folder: str | Path) -> dict[str, StoredTensor]:
    """Every tensor in `folder`'s `*.safetensors` files, by name (headers only: no weight is read).

    Raises:
        ValueError: `folder` has no safetensors file, or one that does not open.
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors file (pytorch_model.bin and other formats are not read; "
                         "save the model with save_pretrained(..., safe_serialization=True))")
    index: dict[str, StoredTensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    index[key] = StoredTensor(tuple(part.get_shape()), _DTYPES.get(part.get_dtype(), torch.float32),
                                              file.name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
            raise ValueError(f"{file} does not open as safetensors ({type(e).__name__}: {e})") from None
    return index


@dataclass(frozen=True)
class _Stacked:
    """A model tensor `(experts, rows, ...)` made of one stored tensor per expert and part (concatenated on dim 1)."""

    parts: tuple[tuple[str, ...], ...]
    """parts[j][e]: the stored name of part j of expert e."""
    rows: tuple[int, ...]
    """The size of each part along dim 1 of the model tensor."""


@dataclass(frozen=True)
class _Concatenated:
    """A model tensor made of row ranges of stored tensors, concatenated along dim 0: several stored tensors
    whole (transformers' Concatenate), or one range of one stored tensor (its Split)."""

    parts: tuple[str, ...]
    """The stored names, in order."""
    starts: tuple[int, ...]
    """The first row of each part that belongs to this tensor."""
    rows: tuple[int, ...]
    """How many rows of each part."""

    def pieces(self, start: int, count: int) -> Iterator[tuple[str, int, int, int]]:
        """(stored name, first row in it, rows, first row in the model's range) covering model rows
        [start, start + count)."""
        offset = 0
        for part, first, rows in zip(self.parts, self.starts, self.rows):
            lo, hi = max(start, offset), min(start + count, offset + rows)
            if lo < hi:
                yield part, first + lo - offset, hi - lo, lo - start
            offset += rows


@dataclass(frozen=True)
class WeightPlan:
    """Where each of a model's state tensors is stored in a checkpoint folder."""

    direct: dict[str, str] = field(default_factory=dict)
    """model name -> stored name (the same, or renamed)."""
    stacked: dict[str, _Stacked] = field(default_factory=dict)
    """model name -> its per-expert stored tensors."""
    tied: dict[str, str] = field(default_factory=dict)
    """model name -> the model name it shares its tensor with (loaded and saved through that one)."""
    concatenated: dict[str, _Concatenated] = field(default_factory=dict)
    """model name -> the stored tensors it is the concatenation of along dim 0."""
    stored: dict[str, StoredTensor] = field(default_factory=dict)
    """What the folder holds (the headers)."""

    def stored_names(self) -> list[str]:
        """Every stored tensor the plan reads (and an export writes), in the model's order."""
        names = list(self.direct.values())
        for stack in self.stacked.values():
            names += [key for e in range(len(stack.parts[0])) for part in stack.parts for key in (part[e],)]
        for stack in self.concatenated.values():
            names += [p for p in stack.parts if p not in names]  # a split tensor's parts share one stored tensor
        return names


def _conversions(model: nn.Module) -> tuple[list[tuple[str, str]], list[WeightConverter]]:
    """transformers' renamings (plain ones, as (stored, model) substrings) and converters for `model`."""
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renames = [(_plain(t.source_patterns[0]), t.target_patterns[0]) for t in transforms
               if isinstance(t, WeightRenaming) and len(t.source_patterns) == 1
               and _LITERAL.match(_plain(t.source_patterns[0])) and _LITERAL.match(t.target_patterns[0])]
    return renames, [t for t in transforms if isinstance(t, WeightConverter)]


def _plain(pattern: str) -> str:
    """A source pattern with its escaped dots unescaped and its start anchor dropped (`^model\\.word_embeddings`
    -> `model.word_embeddings`): transformers writes some literal names as regexes."""
    return pattern.removeprefix("^").replace("\\.", ".")


def _stored_name(name: str, stored: dict[str, StoredTensor], renames: list[tuple[str, str]]) -> str | None:
    """The name `name` is stored under: itself, or with transformers' renamings undone (several may apply in
    turn: Bailing's `.attention.f_proj` -> `.self_attn.f_proj` -> `.self_attn.forget_gate.f_proj`)."""
    candidates = [name]
    for _ in range(3):  # the deepest chain transformers 5.24 writes is 2
        for candidate in candidates:
            if candidate in stored:
                return candidate
        candidates = [c.replace(target, source) for c in candidates for source, target in renames if target in c]
    return next((c for c in candidates if c in stored), None)


def _stacked(name: str, shape: tuple[int, ...], stored: dict[str, StoredTensor], renames: list[tuple[str, str]],
             converters: list[WeightConverter]) -> _Stacked | _Concatenated | str | None:
    """How a stacked-experts tensor is stored (or why it cannot be read), or None if no converter targets it."""
    for converter in converters:
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        target = converter.target_patterns[0] if len(converter.target_patterns) == 1 else None
        if target is None or not name.endswith(target):
            continue
        sources = [_plain(p) for p in converter.source_patterns]
        if ops == [(Concatenate, 0)] and all(_LITERAL.match(p.replace("*", "0")) for p in sources):
            return _concatenated(name[: len(name) - len(target)], sources, shape, stored, renames)
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]) or any(
                p.count("*") != 1 or not _LITERAL.match(p.replace("*", "0")) for p in sources):
            return (f"transformers converts its stored tensors with {[op.__name__ for op, _ in ops]} "
                    "(cpcompose reads experts stacked along dim 0, optionally concatenated along dim 1)")
        prefix = name[: len(name) - len(target)]
        parts = []
        for pattern in sources:
            keys = [_stored_name(prefix + pattern.replace("*", str(e)), stored, renames) for e in range(shape[0])]
            if any(k is None for k in keys):
                return f"its experts' tensors ({prefix + pattern}) are not all in the checkpoint"
            parts.append(tuple(k for k in keys if k is not None))
        rows = tuple(stored[p[0]].shape[0] for p in parts)
        expected = tuple(shape[1:])
        for part, r in zip(parts, rows):
            bad = [k for k in part if stored[k].shape != (r, *expected[1:])]
            if bad:
                return f"{bad[0]} has shape {stored[bad[0]].shape}, expected ({r}, {', '.join(map(str, expected[1:]))})"
        if sum(rows) != expected[0]:
            return f"its parts have {sum(rows)} rows in all, the model's tensor {expected[0]}"
        return _Stacked(tuple(parts), rows)
    return None


def _concatenated(prefix: str, sources: list[str], shape: tuple[int, ...], stored: dict[str, StoredTensor],
                  renames: list[tuple[str, str]]) -> _Concatenated | str:
    """A model tensor stored as parts concatenated along dim 0 (or why it cannot be read). A part with `*`
    (Qwen4-Exp's `ngram_embedding.shard_*.weight`) stands for shards 0, 1, ... as many as are stored."""
    keys: list[str | None] = []
    for pattern in sources:
        if "*" not in pattern:
            keys.append(_stored_name(prefix + pattern, stored, renames))
            continue
        shards = 0
        while (key := _stored_name(prefix + pattern.replace("*", str(shards)), stored, renames)) is not None:
            keys.append(key)
            shards += 1
        if not shards:
            keys.append(None)
    if any(k is None for k in keys):
        return f"its parts ({', '.join(prefix + p for p in sources)}) are not all in the checkpoint"
    parts = tuple(k for k in keys if k is not None)
    bad = [p for p in parts if stored[p].shape[1:] != shape[1:]]
    if bad:
        return f"{bad[0]} has shape {stored[bad[0]].shape}, expected (rows, {', '.join(map(str, shape[1:]))})"
    rows = tuple(stored[p].shape[0] for p in parts)
    if sum(rows) != shape[0]:
        return f"its parts have {sum(rows)} rows in all, the model's tensor {shape[0]}"
    return _Concatenated(parts, (0,) * len(parts), rows)


def _split(name: str, state: dict[str, Tensor], stored: dict[str, StoredTensor], renames: list[tuple[str, str]],
           converters: list[WeightConverter]) -> _Concatenated | str | None:
    """A model tensor that is one of the row ranges one stored tensor is split into along dim 0 (LaraMini's
    `in_proj` -> `in_proj_qkv`, `in_proj_z`, ...: each sized like its model tensor), or None if no Split
    converter targets it."""
    for converter in converters:
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        targets = list(converter.target_patterns)
        found = [t for t in targets if f"{t}." in name or name.endswith(t)]  # `in_proj_qkv` in `...in_proj_qkv.weight`
        if ops != [(Split, 0)] or len(converter.source_patterns) != 1 or len(found) != 1:
            continue
        at = name.rindex(found[0])
        prefix, suffix = name[:at], name[at + len(found[0]):]
        source = prefix + _plain(converter.source_patterns[0]) + suffix
        key = _stored_name(source, stored, renames)
        if key is None or any(prefix + t + suffix not in state for t in targets):
            return f"its stored tensor ({source}) is not in the checkpoint"
        sizes = [state[prefix + t + suffix].shape[0] for t in targets]
        if sum(sizes) != stored[key].shape[0] or stored[key].shape[1:] != state[name].shape[1:]:
            return f"{key} has shape {stored[key].shape}, the {len(targets)} tensors split from it {sum(sizes)} rows"
        i = targets.index(found[0])
        return _Concatenated((key,), (sum(sizes[:i]),), (sizes[i],))
    return None


def weight_plan(model: nn.Module, folder: str | Path) -> WeightPlan:
    """Where each of `model`'s state tensors (parameters and persistent buffers) is stored in `folder`.

    Works on a model on the meta device (shapes only); reads the safetensors headers, no weights.

    Raises:
        ValueError: tensors the plan cannot find, or found with another shape (the first few named), or a
            folder with no readable safetensors.
    """
    stored = read_checkpoint_index(folder)
    renames, converters = _conversions(model)
    state = model.state_dict(keep_vars=True)
    owner: dict[int, str] = {}  # one name per distinct tensor: the first that is stored, else the first
    for name, tensor in state.items():
        if id(tensor) not in owner or (owner[id(tensor)] not in stored and name in stored):
            owner[id(tensor)] = name
    plan = WeightPlan(stored=stored)
    problems = []
    for name, tensor in state.items():
        first = owner[id(tensor)]
        if first != name:
            plan.tied[name] = first
            continue
        shape = tuple(tensor.shape)
        key = _stored_name(name, stored, renames)
        if key is not None:
            if stored[key].shape != shape:
                problems.append(f"{key}: stored with shape {stored[key].shape}, the model's is {shape}")
            plan.direct[name] = key
            continue
        found = _split(name, state, stored, renames, converters) or _stacked(name, shape, stored, renames,
                                                                                converters)
        if isinstance(found, _Concatenated):
            plan.concatenated[name] = found
        elif isinstance(found, _Stacked):
            plan.stacked[name] = found
        else:
            problems.append(f"{name}: " + (found or "not in the checkpoint"))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"{Path(folder)} does not hold {type(model).__name__}'s weights as it expects: "
                         + "; ".join(problems[:5]) + more)
    return plan


def _expert_rows(tensor: Tensor) -> tuple[int, Tensor]:
    """(global index of the first expert this rank holds, its local rows) of a model tensor sharded on dim 0."""
    if not isinstance(tensor, DTensor):
        return 0, tensor
    if any(isinstance(p, Shard) and p.dim != 0 for p in tensor.placements) or not all(
            isinstance(p, Shard) or p.is_replicate() for p in tensor.placements):
        raise ValueError(f"a stacked-experts tensor sharded as {tensor.placements}: only Shard(0) (FSDP's default) "
                         "keeps each expert whole on one rank")
    chunks = tensor.__create_chunk_list__()  # the local shard's offset in the global tensor (as DCP reads it)
    return int(chunks[0].offsets[0]) if chunks else 0, tensor.to_local()


def _expert_pieces(plan: WeightPlan, state: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """(stored name, view into this rank's shard) of every expert tensor this rank holds."""
    for name, stack in plan.stacked.items():
        first, local = _expert_rows(state[name])
        for i in range(local.shape[0]):
            start = 0
            for part, rows in zip(stack.parts, stack.rows):
                yield part[first + i], local[i].narrow(0, start, rows)
                start += rows


def load_pretrained_weights(model: nn.Module, folder: str | Path, plan: WeightPlan | None = None) -> WeightPlan:
    """Read `model`'s weights from `folder` into its (sharded or whole) tensors, in place.

    A collective over the default group when the model's tensors are DTensors (every rank calls it);
    each rank reads only the slices it holds, cast to its tensors' dtype. Tied tensors are tied again
    first: `to_empty` on a model without FSDP gives each module its own new tensor.

    Returns:
        The plan used.
    Raises:
        ValueError: what `weight_plan` raises.
    """
    plan = plan or weight_plan(model, folder)
    _retie(model, plan)
    state = model.state_dict()
    wanted: dict[str, Tensor] = {stored: state[name] for name, stored in plan.direct.items()}
    wanted.update(_expert_pieces(plan, state))
    dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    _load_concatenated(plan, state, Path(folder))
    return plan


def _load_concatenated(plan: WeightPlan, state: dict[str, Tensor], folder: Path) -> None:
    """Each concatenated tensor's local rows, read from the slices of its stored parts they cover (no collective)."""
    for name, concat in plan.concatenated.items():
        first, local = _expert_rows(state[name])
        with torch.no_grad():
            for key, row, rows, at in concat.pieces(first, local.shape[0]):
                with safe_open(str(folder / plan.stored[key].file), framework="pt") as f:
                    local.narrow(0, at, rows).copy_(f.get_slice(key)[row:row + rows])


def _retie(model: nn.Module, plan: WeightPlan) -> None:
    """Point every tied parameter at its twin again (FSDP's `to_empty` keeps ties; `nn.Module.to_empty` does not)."""
    for name, twin in plan.tied.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        shared = model.get_parameter(twin)
        if attr in owner._parameters and owner._parameters[attr] is not shared:
            setattr(owner, attr, shared)


def save_pretrained_weights(model: nn.Module, folder: str | Path, plan: WeightPlan) -> None:
    """Write `model`'s weights into `folder` as `plan`'s checkpoint stores them: the same names, dtypes and files.

    Every rank writes its slices (`HuggingFaceStorageWriter`, distributed), then rank 0 consolidates them
    into whole tensors, one file per file of the source checkpoint, with `model.safetensors.index.json`.
    A collective over the default group (every rank calls it); `folder` must be on storage every rank sees.
    """
    folder = Path(folder)
    state = model.state_dict()
    out: dict[str, Tensor] = {stored: state[name] for name, stored in plan.direct.items()}
    out.update(_expert_pieces(plan, state))
    pieces: dict[str, list[tuple[int, Tensor]]] = {}  # stored name -> (first row, rows) from each model tensor
    for name, concat in plan.concatenated.items():  # small tensors (convs, projections): gathered, in plan order
        tensor = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
        for part, start, rows in zip(concat.parts, concat.starts, tensor.split(list(concat.rows), dim=0)):
            pieces.setdefault(part, []).append((start, rows))
    out.update({part: torch.cat([rows for _, rows in sorted(found, key=lambda x: x[0])]) if len(found) > 1
                else found[0][1] for part, found in pieces.items()})
    out = {k: v.detach().to(plan.stored[k].dtype) for k, v in out.items()}
    names = plan.stored_names()  # every rank's: the writer's coordinator maps all of them to files
    files = sorted({plan.stored[k].file for k in names})
    mapping = {k: files.index(plan.stored[k].file) + 1 for k in names}
    writer = dcp.HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=mapping, save_distributed=True,
                                          enable_consolidation=True)
    dcp.save(out, storage_writer=writer)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(folder / "sharded", ignore_errors=True)  # the per-rank files, consolidated now
    if dist.is_initialized():
        dist.barrier()


def init_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute the buffers no checkpoint holds (RoPE's `inv_freq`, ...), after `to_empty`, in place.

    Each module owning such a buffer is passed to its model's own `_init_weights` (what transformers runs
    after loading), with its parameters marked as initialised so that only the buffers are written. Every
    floating-point buffer is filled with NaN first and checked afterwards, so a buffer `_init_weights` does
    not set is an error, not garbage.

    Returns:
        The names of the buffers recomputed.
    Raises:
        ValueError: a buffer `_init_weights` left unset (named, with its module's class).
    """
    owners: dict[nn.Module, PreTrainedModel] = {}
    for outer in model.modules():
        if isinstance(outer, PreTrainedModel):
            owners.update({m: outer for m in outer.modules()})  # the innermost model wins (visited later)
    names: list[str] = []
    unset: list[tuple[str, Tensor, nn.Module]] = []
    for prefix, module in model.named_modules():
        buffers = [(n, b) for n, b in module.named_buffers(recurse=False)
                   if n in module._non_persistent_buffers_set and b is not None]
        if not buffers or module not in owners:
            continue
        for _, buffer in buffers:
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))
        _init_buffers_of(owners[module], module, recurse=False)
        for name, buffer in buffers:
            full = f"{prefix}.{name}" if prefix else name
            if buffer.is_floating_point() and bool(torch.isnan(buffer).any()):
                unset.append((full, buffer, module))
            else:
                names.append(full)
    for full, buffer, module in unset:
        # Some models set a layer's buffer from an ancestor's branch of `_init_weights` (Falcon-H1's `mup_vector`,
        # set when it is called on the FalconH1Model): try the ancestors, nearest first.
        parts = full.split(".")[:-1]
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = model.get_submodule(".".join(parts[:depth]))
            if ancestor in owners:
                _init_buffers_of(owners[ancestor], ancestor, recurse=True)
            if not bool(torch.isnan(buffer).any()):
                break
        if bool(torch.isnan(buffer).any()):
            raise ValueError(f"the buffer {full} of {type(module).__name__} is in no checkpoint and its model's "
                             "_init_weights does not set it, so it cannot be recomputed after loading")
        names.append(full)
    return names


def _init_buffers_of(owner: PreTrainedModel, module: nn.Module, *, recurse: bool) -> None:
    """`owner._init_weights(module)` with `module`'s parameters marked as initialised, so only buffers are written."""
    params = list(module.parameters(recurse=recurse))
    for p in params:
        p._is_hf_initialized = True  # transformers' init functions skip these: only the buffers are written
    try:
        with torch.no_grad(), hf_init.guard_torch_init_functions():
            owner._init_weights(module)
    finally:
        for p in params:
            del p._is_hf_initialized


def copy_model_files(source: str | Path, folder: str | Path) -> list[str]:
    """Copy `source`'s files other than weights and config.json (tokenizer, chat template, generation config)."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
    copied = []
    for path in sorted(Path(source).iterdir()):
        if path.is_file() and path.name not in ("config.json", _INDEX) and not path.name.endswith(weights):
            shutil.copy2(path, Path(folder) / path.name)
            copied.append(path.name)
    return copied


def export_pretrained(model: nn.Module, folder: str | Path, *, source: str | Path, config: PretrainedConfig,
                      plan: WeightPlan) -> None:
    """Write a folder `from_pretrained` loads: `model`'s weights as `source` stores them, `config`, `source`'s
    tokenizer and other files. A collective (see `save_pretrained_weights`); rank 0 writes the small files.

    Args:
        model: the (sharded or whole) model whose weights to write.
        folder: created if missing.
        source: the folder the model was loaded from (names, dtypes and files of the weights; tokenizer files).
        config: the model's config as it was trained (with any context-extension overrides).
        plan: `weight_plan(model, source)`.
    """
    folder = Path(folder)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in list(folder.glob("*.safetensors")) + [folder / _INDEX]:  # an earlier export's files
            stale.unlink(missing_ok=True)
    if dist.is_initialized():
        dist.barrier()
    save_pretrained_weights(model, folder, plan)
    if rank0:
        copy_model_files(source, folder)
        config = copy.deepcopy(config)
        floats = [t.dtype for t in plan.stored.values() if t.dtype.is_floating_point]
        if floats:  # the dtype the weights are written in (from_config may have changed the config's own)
            config.dtype = max(set(floats), key=floats.count)
        config.save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()
