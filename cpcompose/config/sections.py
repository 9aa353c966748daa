"""The config sections: one dataclass per TOML table, a docstring under every field.

Sections hold and validate the values a user wrote, and nothing else: they import only the standard library,
read no file and fill no default from another section (`cpcompose.config.loader` derives those once, after
parsing). Checks that involve a single section live in its ``__post_init__``; checks across sections live in
:meth:`cpcompose.config.JobConfig.validate`; what needs the model's family, its files or the attention
library is checked by the trainer's resolution step (`cpcompose.training.resolve`). Every failure is a
:class:`ConfigError` whose message starts with the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ActivationCheckpoint", "Checkpoint", "Comm", "ConfigError", "Data", "Job", "LRScheduler",
    "Metrics", "Model", "Optimizer", "Parallelism", "PipelineScheduleName", "StrategyName", "Training", "ValidateWhen", "require",
]

StrategyName = Literal["ring", "allgather", "alltoall", "alltoall_ring", "auto"]
"""`parallelism.cp_strategy`'s choices: `cpcompose.attention`'s `StrategyChoice`, spelled here so that the
sections import nothing but the standard library (tests/config/test_config.py holds the two equal)."""
PipelineScheduleName = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                               "DualPipeV", "LoopedBFS"]
"""`parallelism.pp_schedule`'s choices: `cpcompose.distributed.pipeline.PIPELINE_SCHEDULES`' names (held equal by
tests/config/test_config.py)."""
ValidateWhen = Literal["first_call", "every_call"]
"""`parallelism.cp_validate`'s choices: `cpcompose.attention`'s `Validate` (held equal by the same test)."""


class ConfigError(ValueError):
    """A config value is unknown, malformed or inconsistent; the message names the key to change."""


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError("key: message") unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _positive(section: object, prefix: str, *names: str) -> None:
    for name in names:
        require(getattr(section, name) > 0, f"{prefix}.{name}", f"must be > 0, got {getattr(section, name)}")


@dataclass
class Job:
    """Run identity and output location."""

    name: str = "debug"
    """Run name, shown in the log and the loss plot title."""
    dump_folder: str = "./outputs"
    """Folder for checkpoints, TensorBoard logs and the loss plot (job.name is not added to the path, so give
    each run its own folder); one job at a time (a lock file guards it)."""
    seed: int = 0
    """Seed for parameter init and data; identical on every rank so replicas start equal."""
    dry_run: bool = False
    """Validate the config and print the parallel plan, then exit without training."""
    rehearse: bool = False
    """With job.dry_run: also run one training step of the config at its full size on fake tensors (torch's
    FakeTensorMode, its fake process group with this process as rank 0, its FSDPMemTracker) and print the
    tracker's peak and parts beside the memory plan's tensors. No GPU, no weights (a Hugging Face model needs only
    its config.json); minutes of CPU at full size. Pipelining (parallelism.pp > 1): the pipeline rank with the
    largest planned peak, its stages run in its schedule's order."""
    host_memory_gib: float = 0.0
    """The host memory (RAM) of one node of the cluster the run is for, GiB; 0 = this node's, read from
    /proc/meminfo. On CUDA, what a node's ranks keep in host memory (activation_checkpoint.offload's block inputs,
    training.offload_params' shards, gradients and AdamW moments) must fit in it before launch; the dry run shows
    the figure per rank and per node (LOCAL_WORLD_SIZE ranks). On CPU, where host and device memory are one, it
    replaces this node's RAM in the per-rank budget (divided by the ranks of a node) unless
    training.memory_budget_gib is set."""

    def __post_init__(self) -> None:
        require(0 <= self.host_memory_gib < float("inf"), "job.host_memory_gib",
                f"must be a number of GiB >= 0 (0: this node's memory), got {self.host_memory_gib}")


@dataclass
class Model:
    """Model family and its shape: the fields from vocab_size to norm_eps shape cpcompose's own llama;
    model.name = "hf" reads the shape, the weights and the vocabulary from model.path instead."""

    name: str = "llama"
    """Model family: llama (cpcompose's Llama, from random weights) or hf (a Hugging Face causal LM from
    model.path: attention models such as Llama 3, Qwen 3, Mistral, Gemma 3, DeepSeek-V3/V3.2, GLM-5; and hybrids
    such as Qwen3-Next/3.5, Mamba/Mamba2, Jamba, Bamba, Falcon-H1, Nemotron-H, Zamba, LFM2, Kimi-Linear, MiniMax,
    RecurrentGemma, RWKV, xLSTM. The full list: docs/integrations/transformers.md. A family outside it is probed at
    start, each module under CP against one process, and the first one that differs is named: it never trains on
    shards)."""
    path: str | None = None
    """hf: a local folder as save_pretrained writes it (config.json, *.safetensors, tokenizer files); nothing is
    downloaded. Its tokenizer is the data's unless data.tokenizer is set."""
    vocab_size: int = 320
    """Embedding rows; must cover the data's ids (byte-level text: 258, synthetic: num_symbols + 4).
    hf: read from model.path's config.json."""
    dim: int = 128
    """Hidden size."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads; head_dim = dim / n_heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden_dim: int = 384
    """SwiGLU inner size."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float | None = None
    """RoPE base; long contexts want a larger one (Llama 3: 500000). llama: unset means 10000. hf: unset keeps
    config.json's; set, it replaces it (context extension)."""
    rope_scaling: dict | None = None
    """hf: RoPE scaling for context extension, merged over config.json's RoPE settings (transformers'
    rope_parameters), e.g. [model.rope_scaling] rope_type = "yarn", factor = 4.0 (on the command line as JSON:
    --model.rope_scaling='{"rope_type": "yarn", "factor": 4.0}'); original_max_position_embeddings defaults to
    config.json's max_position_embeddings. For models with settings per layer type (Gemma 3), a table per layer
    type: [model.rope_scaling.full_attention]."""
    max_position_embeddings: int | None = None
    """hf: the longest sequence the model is told it supports (config.json's when unset); training.seq_len may
    not exceed it."""

    def __post_init__(self) -> None:
        _positive(self, "model", "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim")
        require(self.dim % self.n_heads == 0, "model.dim", f"{self.dim} is not divisible by n_heads={self.n_heads}")
        require((self.dim // self.n_heads) % 2 == 0, "model.dim", "head_dim = dim / n_heads must be even for RoPE")
        require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads",
                f"{self.n_kv_heads} must divide n_heads={self.n_heads}")
        require(self.rope_theta is None or self.rope_theta > 0, "model.rope_theta", f"must be > 0, got {self.rope_theta}")
        require(self.max_position_embeddings is None or self.max_position_embeddings > 0,
                "model.max_position_embeddings", f"must be > 0, got {self.max_position_embeddings}")


@dataclass
class Parallelism:
    """Degrees of each parallelism; their product is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or HSDP's outer axis): parameters replicated."""
    dp_shard: int = -1
    """FSDP shard degree; -1 takes whatever the other degrees leave of the world size."""
    cp: int = 1
    """Context-parallel degree: ranks that split one sequence along its length."""
    tp: int = 1
    """Tensor-parallel degree: heads and FFN columns split across ranks."""
    pp: int = 1
    """Pipeline-parallel degree: number of stages the layers are cut into."""
    ep: int = 1
    """Expert-parallel degree for mixture-of-experts models: each MoE layer's experts are dealt to ep ranks (and
    FSDP-sharded over the other dp_shard x cp / ep), and tokens travel to their experts' ranks. Folded out of the
    ranks that share a model replica, as torchtitan does: ep must divide dp_shard x cp, and needs no extra ranks.
    1 = off (every rank gathers every expert, one FSDP unit at a time)."""
    pp_schedule: PipelineScheduleName = "1F1B"
    """Pipeline schedule, torch's by name. One stage per rank: GPipe (every microbatch forward, then every
    backward: holds all microbatches' activations), 1F1B (one forward, one backward: holds at most pp).
    Several (virtual) stages per rank, which shrink the bubble: Interleaved1F1B (torchtitan's default),
    InterleavedZeroBubble (backward split into input and weight parts, the weight parts filling the bubble),
    LoopedBFS (breadth-first: each local stage runs all its microbatches in turn), all placing rank r's stages
    at r, r + pp, r + 2pp, ...; and in a V, two stages per rank, rank r owning stages r and 2pp - 1 - r:
    ZBVZeroBubble and DualPipeV (DeepSeek's). Multi-stage schedules need at least as many microbatches as
    stages."""
    pp_layers_per_stage: int | None = None
    """Transformer layers in each (virtual) pipeline stage, as torchtitan's pipeline_parallel_layers_per_stage:
    model.n_layers / pp_layers_per_stage stages in all, dealt pp_schedule's way, the same number to each rank.
    Unset: one stage per rank for GPipe and 1F1B, two for the multi-stage schedules (a V's two for ZBVZeroBubble
    and DualPipeV)."""
    pp_microbatches: int = 4
    """Microbatches per local batch when pp > 1; must divide it, be >= pp for 1F1B, and >= the stages
    (pp x stages per rank) for the multi-stage schedules."""
    cp_strategy: StrategyName = "ring"
    """ring: K/V blocks circulate, overlapped with compute; allgather: gather all K/V once
    (simple, more memory); alltoall: Ulysses head/sequence transpose (any head count);
    alltoall_ring: 2-D, Ulysses inside blocks of cp_alltoall_size consecutive ranks (keep a
    block inside a node) and a ring across the cp / cp_alltoall_size blocks; auto: the cost model
    picks one of these (and the block size) per attention call, the same on every rank."""
    cp_alltoall_size: int | None = None
    """Ranks per all-to-all block of cp_strategy = "alltoall_ring" (required there, unset otherwise);
    must divide cp. cp_alltoall_size = cp is Ulysses, 1 is the ring."""
    cp_head_chunks: int = 1
    """cp_strategy = "alltoall" only: run attention over this many chunks of heads one after another (UPipe),
    so the all-to-all buffers and attention's full-sequence working set hold one chunk's heads, at 1.5x the
    all-to-all bytes or more (backward exchanges q, k, v, out again; a kv head read by several ranks goes to
    each: Llama-3-8B on cp 8 1.8x at 2 chunks, 2.4x at 4). Must divide the kv heads (per tp rank) and leave
    at least cp query heads per chunk; 1: all heads at once."""
    cp_ring_tiles: int = 1
    """cp_strategy = "ring" or "alltoall_ring" (or "auto", when it picks a ring): the backward makes and sends each
    round's float32 dK/dV home in this many pieces of its key rows, so those buffers (three in flight) are a
    piece's, not a shard's: at 625k tokens per rank of Llama-3-8B, 4 pieces save 7 GiB. More, smaller messages;
    exact. 1: one piece per round."""
    cp_layout: str = "zigzag"
    """A registered layout (zigzag, contiguous): zigzag gives rank r chunks r and 2cp-1-r so causal
    work is balanced; contiguous gives chunk r. Packed documents (data.pack) are split per batch."""
    cp_calibration: str | None = None
    """cp_strategy = "auto" only: a JSON of machine constants written by
    `python -m cpcompose.attention.cost.calibrate` (unset: the shipped defaults for the device type; see
    docs/strategy_choice.md)."""
    cp_verify: bool = True
    """Run the exactness probe at start (two forwards of a copy of the model at 16 tokens per CP rank, before
    FSDP): every module's output under CP must equal the single-process one, or the run stops naming the first
    module that differs (a token mixer that is not CP-aware)."""
    cp_validate: ValidateWhen = "first_call"
    """first_call: the blocking cross-rank check of each attention call's shapes and options runs
    for a new call signature only (no host sync at steady state); every_call: on every call, a
    debug mode that also catches one rank changing its inputs alone (see README, What is checked when)."""

    def __post_init__(self) -> None:
        _positive(self, "parallelism", "dp_replicate", "cp", "tp", "pp", "ep", "pp_microbatches")
        require(self.dp_shard == -1 or self.dp_shard >= 1, "parallelism.dp_shard",
                f"must be >= 1 or -1, got {self.dp_shard}")
        require(self.pp_layers_per_stage is None or self.pp_layers_per_stage >= 1, "parallelism.pp_layers_per_stage",
                f"must be >= 1 (or unset), got {self.pp_layers_per_stage}")


@dataclass
class Training:
    """Steps, shapes and numerics."""

    steps: int = 100
    """Optimizer steps to run."""
    seq_len: int = 512
    """Tokens per sequence before context-parallel sharding."""
    batch_size: int = 8
    """Global batch: sequences per optimizer step summed over all data-parallel ranks
    (dp_replicate * dp_shard) and all grad_accum_steps micro-steps; cp/tp/pp ranks share sequences and
    do not multiply it. Each dp rank loads batch_size / (dp * grad_accum_steps) sequences per micro-step."""
    grad_accum_steps: int = 1
    """Micro-steps whose gradients are summed before each optimizer step."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this; <= 0 disables clipping."""
    mixed_precision: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; parameters, gradient reduction and the LSE merge stay float32."""
    compile: bool = False
    """torch.compile each transformer block whole (fullgraph; CP attention is one custom op in it).

    With activation checkpointing, each block's parts, inside the checkpoint. model.name = "hf": each decoder
    layer, for the families that compile (others are refused by name before launch)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto picks cuda when available, else cpu (gloo)."""
    fused_loss: bool = True
    """Compute the loss from the final hidden states and the output weight a chunk of tokens at a time
    (cp_linear_cross_entropy), never making the seq x vocab logits: the same loss and gradients, a fraction of
    the memory at large vocabularies. On CUDA a fused kernel is used when installed (pip install
    'cpcompose[fused-loss]'). With parallelism.pp > 1 it does not apply: the last pipeline stage makes the
    logits and takes the unfused loss."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the fused loss: it holds loss_chunk_tokens x vocab_size float32 logits at a time.
    Unset: the multiple of 128 tokens whose logits fill at most 256 MiB, between 128 and 4096 (a 128,256-token
    vocabulary: 512; 32,000: 2,048; up to 16,384: 4,096), so a large vocabulary's chunk stays small."""
    tiled_mlp: int = 1
    """Run every feed-forward over this many tiles of the local sequence, recomputing each in backward, so its
    seq x ffn_hidden_dim intermediates are never whole (DeepSpeed ALST's TiledMLP); exact, one more MLP
    forward per step. 1 = off. Not with training.compile."""
    tiled_block: int = 1
    """Run every block's token-wise parts (RMSNorms, q/k/v projections, RoPE, the output projection and the
    feed-forward) over this many tiles of the local sequence, recomputing each in backward: a block then keeps its
    input, q, k, v and the attention's output, nothing else at full length; exact, one more forward of those parts
    per step. It tiles the feed-forward too (training.tiled_mlp then adds nothing). 1 = off. The own Llama only,
    not with training.compile, parallelism.tp or parallelism.pp."""
    offload_params: bool = False
    """Keep each rank's shard of the parameters, their gradients and the optimizer state in host memory (FSDP2's
    CPUOffloadPolicy: gathered to the device per unit, the optimizer step on the CPU). One rank over dp x cp is
    sharded with FSDP2 over itself for it (one GPU: the whole model's state on the host). Needs
    parallelism.pp = 1."""
    memory_budget_gib: float | None = None
    """Per-rank memory the run may use: the memory plan must fit in it before launch, and a rank that passes it
    stops, saying so. Unset: the device's memory (CUDA) or the host's RAM divided by the ranks on it (CPU)."""

    def __post_init__(self) -> None:
        _positive(self, "training", "steps", "batch_size", "grad_accum_steps", "tiled_mlp", "tiled_block")
        if self.loss_chunk_tokens is not None:
            _positive(self, "training", "loss_chunk_tokens")
        require(self.seq_len >= 2, "training.seq_len", f"must be >= 2, got {self.seq_len}")
        require(self.tiled_mlp == 1 or not self.compile, "training.tiled_mlp",
                f"{self.tiled_mlp} tiles do not compile (the tiles' backward recomputes under autograd): set it to "
                "1, or training.compile = false")
        require(self.tiled_block == 1 or not self.compile, "training.tiled_block",
                f"{self.tiled_block} tiles do not compile (the tiles' backward recomputes under autograd): set it to "
                "1, or training.compile = false")
        require(self.memory_budget_gib is None or 0 < self.memory_budget_gib < float("inf"),
                "training.memory_budget_gib", f"must be a positive number of GiB, got {self.memory_budget_gib}")


_TEXT_ONLY = {"path": None, "tokenizer": None, "eos_token": None, "format": "text", "text_key": "text",
              "prompt_key": "prompt", "completion_key": "completion", "messages_key": "messages",
              "chat_mask": "generation", "truncate": False, "store": True, "store_dir": None,
              "sources": [], "store_wait_s": 3600.0}
"""Data fields that only data.source = "text" reads, with their defaults: setting one for synthetic data is an error."""

_FORMAT_ONLY = {"text_key": ("text",), "prompt_key": ("completion",), "completion_key": ("completion",),
                "messages_key": ("chat",), "chat_mask": ("chat",), "truncate": ("completion", "chat")}
"""Data fields that only some data.format values read."""


_SOURCE_KEYS = {"path": None, "weight": 1.0, "long_doc_tokens": None, "long_doc_repeat": 1}
"""The keys of one [[data.sources]] table, with their defaults (path is required)."""


def source_table(index: int, entry: object) -> dict:
    """One [[data.sources]] table, checked, completed with the defaults (what the loader keeps)."""
    key = f"data.sources[{index}]"
    require(isinstance(entry, dict), key, f"must be a table such as {{path = \"a/\", weight = 1}}, got {entry!r}")
    assert isinstance(entry, dict)
    unknown = sorted(set(entry) - set(_SOURCE_KEYS))
    require(not unknown, key, f"unknown key(s) {', '.join(unknown)}; a source has {', '.join(_SOURCE_KEYS)}")
    table = {**_SOURCE_KEYS, **entry}
    require(isinstance(table["path"], str) and table["path"] != "", f"{key}.path", "required: a file or folder")
    weight = table["weight"]
    require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < float("inf"),
            f"{key}.weight", f"must be a positive number, got {weight!r}")
    long, repeat = table["long_doc_tokens"], table["long_doc_repeat"]
    require(long is None or (isinstance(long, int) and long >= 1), f"{key}.long_doc_tokens",
            f"must be a positive integer, got {long!r}")
    require(isinstance(repeat, int) and repeat >= 1, f"{key}.long_doc_repeat",
            f"must be an integer >= 1, got {repeat!r}")
    require(repeat == 1 or long is not None, f"{key}.long_doc_repeat", "needs long_doc_tokens (which documents)")
    return {**table, "weight": float(weight)}


@dataclass
class Data:
    """Where sequences come from."""

    source: Literal["synthetic", "text"] = "synthetic"
    """synthetic: a long-context task generated on the fly (see data.task); text: your files at data.path."""
    task: Literal["copy", "recall"] = "copy"
    """Synthetic: copy (the second half repeats the first; debug_cpu.toml: loss 0.4 by step 300) or recall
    (key/value pairs queried at the end; harder). Both need attention across CP shards to be solved."""
    path: str | None = None
    """A .txt file (one document), a .jsonl file (one JSON object per line), a .parquet file (one record per row;
    needs pyarrow) or a folder of them (read recursively in sorted order; also the .arrow shards of a dataset
    saved with `datasets`' save_to_disk), or a token store built by `python -m cpcompose.data.build_token_store`."""
    format: Literal["text", "completion", "chat"] = "text"
    """text: documents for continued pretraining, loss on every token; completion: {prompt, completion} records,
    loss on the completion and its EOS; chat: {messages: [{role, content}, ...]} records rendered with the
    tokenizer's chat template, loss on the assistant's tokens. completion and chat records are packed whole."""
    text_key: str = "text"
    """format = "text": the field of a .jsonl object / .parquet column holding the document."""
    prompt_key: str = "prompt"
    """format = "completion": the field holding the prompt (no loss)."""
    completion_key: str = "completion"
    """format = "completion": the field holding the completion (the loss)."""
    messages_key: str = "messages"
    """format = "chat": the field holding the list of {role, content} messages."""
    chat_mask: Literal["generation", "incremental"] = "generation"
    """format = "chat": how the assistant's tokens are found. generation: the template's {% generation %}
    markers (transformers' assistant mask; a template without them is refused before launch); incremental:
    render the conversation one message at a time and train on what each assistant message adds (for templates
    without markers; a template that rewrites earlier turns is refused per record)."""
    truncate: bool = False
    """completion/chat: a record longer than training.seq_len is an error (before launch) unless this is true,
    which keeps its first seq_len tokens (a record left with no trained token is dropped)."""
    tokenizer: str | None = None
    """A tokenizer folder (tokenizer_config.json etc., read with transformers' AutoTokenizer, local files only)
    or a `tokenizers` JSON file. Unset: model.path's tokenizer when model.name = "hf", else byte-level
    (bytes 0-255, BOS 256, EOS 257)."""
    eos_token: str | None = None
    """EOS token string; none takes the tokenizer's own (a folder's eos_token; a JSON file: common names such
    as </s>, <|end_of_text|>)."""
    pack: bool | None = None
    """Keep document boundaries (cu_seqlens) so attention, every mixer and the loss restart at each document.
    Unset: on for completion/chat (always packed), off for text (windows over the concatenated documents)."""
    num_symbols: int = 64
    """Synthetic: ordinary symbols (ids 0..num_symbols-1): copied symbols, or keys, values and filler."""
    num_pairs: int = 16
    """Synthetic recall: key/value pairs scattered through the first key_fraction of each sequence."""
    num_queries: int = 4
    """Synthetic recall: queries at the end of each sequence; only their answers carry a loss."""
    key_fraction: float = 0.5
    """Synthetic recall: fraction of the sequence that holds the pairs; 0.5 puts keys on every zigzag cp rank."""
    filler: Literal["random", "constant"] = "random"
    """Synthetic recall: tokens between pairs; constant makes the task easier to learn."""
    store: bool = True
    """Read the files through token stores: each source is tokenized once into a memory-mapped store (in
    data.store_dir; rebuilt when a source file, the tokenizer or the record options change) that every rank
    reads without loading; packed rows are filled by best fit. false tokenizes the whole corpus in memory on
    every rank at every start and writes nothing to disk (modest corpora only; not with [[data.sources]])."""
    store_dir: str | None = None
    """Folder of the token stores and their sample indexes. Unset: the per-user cache,
    $XDG_CACHE_HOME/cpcompose/token-stores (else ~/.cache/cpcompose/token-stores); the banner names the folder."""
    sources: list = field(default_factory=list)
    """A mixture, instead of data.path: [[data.sources]] tables with path (files, a folder, or a token store
    built by `python -m cpcompose.data.build_token_store`), weight (share of the samples, default 1;
    normalized), and for packed data long_doc_tokens / long_doc_repeat (documents at least that long are packed
    repeat times: the long-context upsampling recipe). Read from token stores (data.store). On the command line, JSON:
    --data.sources='[{"path": "a/", "weight": 0.7}, {"path": "b/", "weight": 0.3}]'."""
    store_wait_s: float = 3600.0
    """How long a process waits for another one's build of the same token store before giving up."""

    def packed(self) -> bool:
        """Whether rows keep document boundaries: data.pack, or unset, on for completion/chat records (always
        packed), off for text (windows over the concatenated documents)."""
        return self.source == "text" and (self.pack if self.pack is not None else self.format != "text")

    def __post_init__(self) -> None:
        require(self.source != "text" or (self.path is None) != (not self.sources), "data.path",
                "required when data.source = 'text', unless [[data.sources]] lists the sources (not both)")
        require(self.store_dir is None or self.store_dir.strip() != "", "data.store_dir",
                "is empty: give a folder for the token stores, or leave it unset to keep them in the per-user "
                "cache, or set data.store = false to tokenize in memory")
        require(self.store or not self.sources, "data.store",
                "false tokenizes one data.path in memory, but [[data.sources]] is a mixture of token stores: "
                "remove data.store = false")
        require(self.store or self.store_dir is None, "data.store_dir",
                "is where token stores go, but data.store = false tokenizes in memory: remove one of the two")
        for i, entry in enumerate(self.sources):
            source_table(i, entry)
        require(self.store_wait_s > 0, "data.store_wait_s", f"must be > 0, got {self.store_wait_s}")
        require(not self.pack or self.source == "text", "data.pack", "only applies to data.source = 'text'")
        for name, default in _TEXT_ONLY.items():  # ignored by synthetic data: say so rather than drop it
            require(self.source == "text" or getattr(self, name) == default, f"data.{name}",
                    "only applies to data.source = 'text'; add --data.source=text or remove it")
        for name, formats in _FORMAT_ONLY.items():
            require(self.format in formats or getattr(self, name) == _TEXT_ONLY[name], f"data.{name}",
                    f"only applies to data.format = {' or '.join(map(repr, formats))}, not {self.format!r}")
        require(self.format == "text" or self.pack is not False, "data.pack",
                f"{self.format} records are always packed whole with their boundaries; remove data.pack = false")
        require(self.num_symbols >= 2, "data.num_symbols", f"must be >= 2, got {self.num_symbols}")
        require(1 <= self.num_pairs <= self.num_symbols, "data.num_pairs",
                f"must be in [1, num_symbols], got {self.num_pairs}")
        require(1 <= self.num_queries <= self.num_pairs, "data.num_queries",
                f"must be in [1, num_pairs], got {self.num_queries}")
        require(0 < self.key_fraction < 1, "data.key_fraction", f"must be in (0, 1), got {self.key_fraction}")


@dataclass
class Optimizer:
    """Optimizer settings."""

    name: Literal["AdamW"] = "AdamW"
    """Optimizer class from torch.optim; fused (one kernel per parameter group, updating in place: torchtitan's
    default), which on CPU also spares a step the per-parameter temporaries glibc maps afresh."""
    lr: float = 1e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas; on the command line: --optimizer.betas=0.9,0.95."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    eps: float = 1e-8
    """Adam epsilon."""

    def __post_init__(self) -> None:
        _positive(self, "optimizer", "lr", "eps")
        require(all(0 <= b < 1 for b in self.betas), "optimizer.betas", f"each must be in [0, 1), got {self.betas}")
        require(self.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")


@dataclass
class LRScheduler:
    """Learning-rate schedule."""

    name: Literal["cosine", "constant"] = "cosine"
    """Shape after warmup."""
    warmup_steps: int = 10
    """Linear warmup from 0 to optimizer.lr. More than training.steps is shortened to training.steps (the
    run's banner says so), so that a short trial (--training.steps=3) of a long run's config runs as is."""
    min_lr_ratio: float = 0.1
    """Cosine ends at lr * min_lr_ratio."""

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(0 <= self.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class Checkpoint:
    """Distributed checkpoints (model, optimizer, scheduler, data position)."""

    enable: bool = False
    """Save checkpoints."""
    folder: str = "checkpoint"
    """Sub-folder of job.dump_folder."""
    interval: int = 100
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 2
    """Delete older checkpoints beyond this many (the one just written always stays); 0 keeps all."""
    resume: bool = True
    """With checkpoint.enable, resume from the newest intact checkpoint in folder (corrupt ones are skipped
    and renamed step-N.corrupt). false starts a new run, which the folder must not already hold checkpoints for."""
    export_hf: str | None = None
    """model.name = "hf": when training ends, write the model to this folder (a relative path: inside
    job.dump_folder, as checkpoint.folder) as a Hugging Face model
    (from_pretrained loads it): the weights as model.path stores them (names, dtypes, files), config.json with the
    model.rope_* / max_position_embeddings overrides, and model.path's tokenizer files. On a run already at
    training.steps it resumes the last checkpoint and only exports. A folder holding another run's export (or
    files no export wrote) is refused before launch."""

    def __post_init__(self) -> None:
        _positive(self, "checkpoint", "interval")
        require(self.keep_latest_k >= 0, "checkpoint.keep_latest_k", f"must be >= 0, got {self.keep_latest_k}")


@dataclass
class Metrics:
    """Logging."""

    log_freq: int = 10
    """Log loss and throughput every this many steps."""
    enable_tensorboard: bool = False
    """Write TensorBoard scalars (from one rank only)."""
    save_tb_folder: str = "tb"
    """TensorBoard sub-folder of job.dump_folder."""
    plot_loss: bool = False
    """Save a loss-curve PNG, job.dump_folder/loss.png, when training ends."""

    def __post_init__(self) -> None:
        _positive(self, "metrics", "log_freq")


@dataclass
class ActivationCheckpoint:
    """Recompute activations in backward to save memory."""

    mode: Literal["none", "full"] = "none"
    """full recomputes every transformer block."""
    offload: bool = False
    """With mode = "full": keep each block's checkpointed input in pinned host memory between forward and
    backward (`cpcompose.distributed.host_offload`), so the GPU holds no layer inputs; exact. On the CPU it is
    accepted and changes nothing (the inputs are in host memory already)."""

    def __post_init__(self) -> None:
        require(not self.offload or self.mode == "full", "activation_checkpoint.offload",
                'moves what full checkpointing saves: set activation_checkpoint.mode = "full" too')


@dataclass
class Comm:
    """Collective timeouts."""

    timeout_s: float = 300.0
    """Timeout of each collective after initialization."""
    init_timeout_s: float = 600.0
    """Timeout of process-group setup, while the ranks start and meet; every collective after it uses
    comm.timeout_s."""

    def __post_init__(self) -> None:
        _positive(self, "comm", "timeout_s", "init_timeout_s")
