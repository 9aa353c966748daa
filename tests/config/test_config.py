"""cpcompose.config: precedence, conversion, errors that name the key, --help, the shipped TOML files."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from cpcompose.config import ConfigError, JobConfig, cp_options, load_config
from cpcompose.config.loader import _field_docs
from cpcompose.distributed import ParallelDims
from cpcompose.training.resolve import resolve_config

REPO = Path(__file__).resolve().parents[2]


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_load_and_to_dict_has_every_section() -> None:
    config = load_config([])
    defaults = JobConfig()  # as written: data.pack unset, which the loader derives (off for text)
    assert defaults.data.pack is None and config.data.pack is False
    assert config == dataclasses.replace(defaults, data=dataclasses.replace(defaults.data, pack=False))
    sections = config.to_dict()
    assert list(sections) == [f.name for f in dataclasses.fields(JobConfig)]
    assert sections["training"]["seq_len"] == config.training.seq_len


def test_cli_wins_over_toml_wins_over_defaults(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[training]\nsteps = 50\nseq_len = 256\n[optimizer]\nlr = 0.5\n")
    config = load_config(["--config", path, "--training.steps=70", "--optimizer.lr", "0.25"])
    assert config.training.steps == 70  # CLI over TOML
    assert config.optimizer.lr == 0.25  # CLI, space-separated form
    assert config.training.seq_len == 256  # TOML over default
    assert config.training.batch_size == JobConfig().training.batch_size  # default
    # The order on the command line does not matter: overrides apply after the file.
    assert load_config(["--training.steps=70", f"--config={path}"]).training.steps == 70


def test_values_are_converted_by_annotation(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[optimizer]\nbetas = [0.8, 0.9]\nlr = 1\n[job]\ndry_run = true\n")
    config = load_config(["--config", path])
    assert config.optimizer.betas == (0.8, 0.9) and config.optimizer.lr == 1.0
    assert isinstance(config.optimizer.lr, float) and config.job.dry_run is True
    config = load_config(["--optimizer.betas=0.7,0.99", "--job.dry_run=0", "--training.compile", "1",
                          "--metrics.enable_tensorboard", "--data.tokenizer=tok.json", "--data.source=text", "--data.path=corpus",
                          "--parallelism.cp_layout",
                          "contiguous"])
    assert config.optimizer.betas == (0.7, 0.99)
    assert config.job.dry_run is False and config.training.compile is True
    assert config.metrics.enable_tensorboard is True  # a bare bool flag means true
    assert config.data.tokenizer == "tok.json" and config.parallelism.cp_layout == "contiguous"
    assert load_config(["--data.tokenizer=tok.json", "--data.tokenizer=none"]).data.tokenizer is None  # last wins


@pytest.mark.parametrize(
    "toml, argv, message",
    [
        ("[training]\nseqlen = 5\n", [],
         r"unknown key 'training.seqlen' in .*run.toml \(did you mean 'training.seq_len'\?\)"),
        ("[trainin]\nsteps = 5\n", [], r"unknown section '\[trainin\]' in .*run.toml \(did you mean 'training'\?\)"),
        ("[training]\nsteps = \"many\"\n", [], r"^training.steps: expected int, got 'many'"),
        ("[training]\nsteps = 2.5\n", [], r"^training.steps: expected int, got 2.5"),
        ("[parallelism]\ncp_strategy = \"foo\"\n", [],
         r"^parallelism.cp_strategy: 'foo' is not one of ring, allgather, alltoall"),
        ("training = 3\n", [], r"^training: must be a \[training\] table"),
        ("[training\n", [], r"^config: .*run.toml is not valid TOML"),
        ("", ["--training.seqlen=5"], r"unknown option '--training.seqlen' \(did you mean '--training.seq_len'\?\)"),
        # Suggestions search every section: the key's name decides, its section breaks ties.
        ("", ["--training.lr=1e-3"], r"unknown option '--training.lr' \(did you mean '--optimizer.lr'\?\)$"),
        ("", ["--training.warmup=3"], r"\(did you mean '--lr_scheduler.warmup_steps'\?\)$"),
        ("", ["--model.step=3"], r"\(did you mean '--training.steps'\?\)$"),
        ("", ["--training.learning_rate=1"], r"\(did you mean '--optimizer.lr'\?\)$"),
        ("", ["--training.name=x"], r"\(did you mean '--\w+.name' or '--\w+.name' or '--\w+.name'\?\)$"),
        ("[training]\nlr = 0.1\n", [], r"unknown key 'training.lr' in .*run.toml \(did you mean 'optimizer.lr'\?\)$"),
        ("", ["--training.zzzz=1"], r"unknown option '--training.zzzz'$"),
        # What this trainer lacks is said, not matched to a near spelling elsewhere (ep is not optimizer.eps).
        ("", ["--parallelism.etp=2"], r"unknown option '--parallelism.etp': experts are not split by tensor"),
        ("[parallelism]\nexpert_parallel_degree = 2\n", [], r"\(did you mean 'parallelism.ep'\?\)$"),
        ("", ["--parallelism.tpp=2"], r"\(did you mean '--parallelism.tp'\?\)$"),
        ("", ["--training.seq_len=abc"], r"^training.seq_len: expected int, got 'abc'"),
        ("", ["--job.dry_run=maybe"], r"^job.dry_run: expected bool \(true/false/1/0\), got 'maybe'"),
        ("", ["--optimizer.lr=fast"], r"^optimizer.lr: expected float, got 'fast'"),
        ("", ["--optimizer.betas=0.9"], r"^optimizer.betas: expected 2 comma-separated values"),
        ("", ["--optimizer.betas=0.9,x"], r"^optimizer.betas: expected float, got 'x'"),
        ("", ["--parallelism.cp_layout=diagonal"],
         r"^parallelism.cp_layout: 'diagonal' is unknown; choose one of \('zigzag', 'contiguous'\)"),
        ("", ["--training.steps"], r"^training.steps: missing value"),
        ("", ["stray"], r"^stray: unexpected argument"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, toml: str, argv: list[str], message: str) -> None:
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", path, *argv])


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config: cannot read .*nope.toml"):
        load_config(["--config", str(tmp_path / "nope.toml")])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallelism.cp=2", "--training.seq_len=1022"],
         r"^training.seq_len: sequence length 1022 is not divisible by 4: the zigzag layout over 2 CP ranks"),
        (["--training.seq_len=2"], r"^training.seq_len: 2 must be even and >= 4 for the copy task"),
        (["--model.name=gpt"], r"^model.name: 'gpt' is not one of llama"),
        (["--parallelism.tp=3"], r"^model.n_heads: 4 must be divisible by parallelism.tp = 3"),
        (["--parallelism.tp=4"], r"^model.n_kv_heads: 2 must be divisible by parallelism.tp = 4"),
        (["--parallelism.pp=3"], r"^model.n_layers: 4 must be divisible by parallelism.pp = 3"),
        (["--parallelism.pp=4", "--parallelism.pp_microbatches=2"],
         r"^parallelism.pp_microbatches: 1F1B needs >= pp = 4"),
        (["--training.grad_accum_steps=3"], r"^training.batch_size: 8 must be divisible by .* = 3"),
        (["--data.task=recall", "--data.num_symbols=256", "--data.num_pairs=100"], r"^data.num_pairs: 100 triples \(KEY k v\) do not fit"),
        (["--data.task=recall", "--data.num_queries=16", "--data.key_fraction=0.95"],
         r"^data.num_queries: 16 triples \(QUERY k v\) do not fit"),
        (["--data.source=text"], r"^data.path: required when data.source = 'text'"),
        (["--data.pack=true"], r"^data.pack: only applies to data.source = 'text'"),
        (["--model.n_kv_heads=3"], r"^model.n_kv_heads: 3 must divide n_heads=4"),
        (["--model.dim=130"], r"^model.dim: 130 is not divisible by n_heads=4"),
        (["--training.steps=0"], r"^training.steps: must be > 0, got 0"),
        (["--parallelism.dp_shard=0"], r"^parallelism.dp_shard: must be >= 1 or -1, got 0"),
        (["--optimizer.betas=0.9,1.0"], r"^optimizer.betas: each must be in \[0, 1\)"),
        (["--training.loss_chunk_tokens=0"], r"^training.loss_chunk_tokens: must be > 0, got 0"),
        (["--training.tiled_mlp=0"], r"^training.tiled_mlp: must be > 0, got 0"),
        (["--training.tiled_mlp=2", "--training.compile=true"], r"^training.tiled_mlp: 2 tiles do not compile"),
        (["--training.tiled_block=0"], r"^training.tiled_block: must be > 0, got 0"),
        (["--parallelism.cp=2", "--parallelism.cp_ring_tiles=0"], r"^parallelism.cp_ring_tiles: 0 must be a positive"),
        (["--parallelism.cp=2", "--parallelism.cp_strategy=allgather", "--parallelism.cp_ring_tiles=2"],
         r"^parallelism.cp_ring_tiles: 2 pieces the ring's backward, and parallelism.cp_strategy='allgather' runs no"),
        (["--training.tiled_block=2", "--training.compile=true"], r"^training.tiled_block: 2 tiles do not compile"),
        (["--training.tiled_block=2", "--parallelism.tp=2"], r"^training.tiled_block: tiles the own Llama's blocks "
                                                              r"with parallelism.tp = 1 and pp = 1 only"),
        (["--activation_checkpoint.offload=true"], r'^activation_checkpoint.offload: .*mode = "full"'),
        (["--job.rehearse=true"], r"^job.rehearse: rehearses the dry run's step: add --job.dry_run"),
    ],
)
def test_inconsistent_values_name_the_key(argv: list[str], message: str) -> None:
    """Read and checked as `python -m cpcompose.train` does before launch (the schema, then the resolution step:
    model families and data tasks)."""
    with pytest.raises(ConfigError, match=message):
        resolve_config(load_config(argv))


def test_seq_len_divisibility_follows_the_layout() -> None:
    argv = ["--parallelism.cp=2", "--training.seq_len=1022"]
    assert load_config([*argv, "--parallelism.cp_layout=contiguous"]).training.seq_len == 1022
    with pytest.raises(ConfigError, match=r"^training.seq_len: .* not divisible by 4: the zigzag layout over 2 CP"):
        load_config(argv)


def test_alltoall_accepts_heads_not_divisible_by_cp() -> None:
    """Ulysses all-to-all handles any head count (uneven head groups), so no rule ties heads to cp."""
    config = load_config(["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall", "--model.n_heads=2",
                          "--model.n_kv_heads=1", "--model.dim=64"])
    config.validate(world_size=4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall_ring"],
         r"^parallelism.cp_alltoall_size: parallelism.cp_strategy='alltoall_ring' needs parallelism.cp_alltoall_size .* a divisor of the 4 CP ranks"),
        (["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall_ring", "--parallelism.cp_alltoall_size=3"],
         r"^parallelism.cp_alltoall_size: 3 must be a positive int that divides the 4 CP ranks"),
        (["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall_ring", "--parallelism.cp_alltoall_size=0"],
         r"^parallelism.cp_alltoall_size: 0 must be a positive int that divides"),
        (["--parallelism.cp=4", "--parallelism.cp_alltoall_size=2"],
         r"^parallelism.cp_alltoall_size: 2 is only used by parallelism.cp_strategy='alltoall_ring' \(got parallelism.cp_strategy='ring'\)"),
    ],
)
def test_twod_degrees_are_checked_when_read(argv: list[str], message: str) -> None:
    """The 2-D block size is checked against cp when the config is read, before any process group."""
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_twod_config_gives_its_options() -> None:
    config = load_config(["--parallelism.cp=4", "--parallelism.cp_strategy=alltoall_ring",
                          "--parallelism.cp_alltoall_size=2"])
    config.validate(world_size=4)
    options = cp_options(config.parallelism)
    assert (options.strategy, options.alltoall_size) == ("alltoall_ring", 2)
    assert options.error(4) is None


def test_validate_with_world_size_checks_the_product_without_changing_the_config() -> None:
    config = load_config(["--parallelism.cp=2", "--parallelism.dp_replicate=2"])
    before = config.to_dict()
    config.validate(world_size=8)
    assert config.to_dict() == before and config.parallelism.dp_shard == -1  # validate only reads
    assert ParallelDims.from_config(config.parallelism, 8).dp_shard == 2  # the degrees' owner resolves -1
    with pytest.raises(ConfigError, match=r"^parallelism.dp_shard: -1 needs world size 6 divisible by .* = 4"):
        load_config(["--parallelism.cp=2", "--parallelism.dp_replicate=2"]).validate(world_size=6)
    with pytest.raises(ConfigError, match=r"^parallelism.dp_shard: .* = 6 but the world size is 4"):
        config = load_config(["--parallelism.dp_shard=3", "--parallelism.cp=2", "--training.batch_size=6"])
        config.validate(world_size=4)
    with pytest.raises(ConfigError, match=r"^training.batch_size: 8 must be divisible by .* = 16"):
        load_config([]).validate(world_size=16)
    with pytest.raises(ConfigError, match=r"^parallelism.pp_microbatches: 4 must divide the local batch of 2"):
        load_config(["--parallelism.pp=2"]).validate(world_size=8)


def test_help_lists_every_field_with_its_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_config(["--training.steps=3", "--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for section in dataclasses.fields(JobConfig):
        docs = _field_docs(section.default_factory)  # type: ignore[misc]
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            option = next(i for i, line in enumerate(lines) if line.startswith(f"  --{section.name}.{f.name}  ("))
            assert "default: " in lines[option]
            assert docs[f.name], f"{section.name}.{f.name} has no docstring"
            assert lines[option + 1].startswith("      ") and docs[f.name].startswith(lines[option + 1].strip())
    assert '  --parallelism.cp_strategy  (ring|allgather|alltoall|alltoall_ring|auto, default: "ring")' in lines
    assert "  --parallelism.cp_alltoall_size  (int | none, default: none)" in lines
    assert "  --data.path  (str | none, default: none)" in lines


def test_help_from_a_fresh_interpreter_exits_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from cpcompose.config import load_config; load_config(['--help'])"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--training.seq_len" in result.stdout and "[activation_checkpoint]" in result.stdout


@pytest.mark.parametrize("name, world_size", [("debug_cpu.toml", 2), ("llama3_8b_128k.toml", 64)])
def test_shipped_configs_load_and_validate(name: str, world_size: int) -> None:
    config = load_config(["--config", str(REPO / "train_configs" / name)])
    config.validate(world_size=world_size)
    assert config.parallelism.cp > 1
    dims = ParallelDims.from_config(config.parallelism, world_size)
    assert dims.dp_replicate * dims.dp_shard * dims.cp == world_size


def test_llama3_8b_config_has_the_llama3_shape() -> None:
    config = load_config(["--config", str(REPO / "train_configs" / "llama3_8b_128k.toml")])
    m = config.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden_dim, m.vocab_size) == (
        4096, 32, 32, 8, 14336, 128256)
    assert config.training.seq_len == 131072 and config.training.mixed_precision == "bfloat16"
    assert config.activation_checkpoint.mode == "full" and config.parallelism.cp == 8


def test_validate_mode_reaches_the_attention_options() -> None:
    """`parallelism.cp_validate` is the trainer's switch for the every-call agreement (a debug mode)."""
    assert cp_options(load_config([]).parallelism).validate == "first_call"
    config = load_config(["--parallelism.cp_validate=every_call"])
    assert cp_options(config.parallelism).validate == "every_call"
    with pytest.raises(ConfigError, match="cp_validate"):
        load_config(["--parallelism.cp_validate=sometimes"])


def test_auto_calibration_file(tmp_path) -> None:
    """`parallelism.cp_calibration`: a calibration JSON for `auto`, checked when the config is read."""
    from cpcompose.attention.cost import CPU_DEFAULT

    path = tmp_path / "machine.json"
    CPU_DEFAULT.save(path)
    options = cp_options(load_config(["--parallelism.cp_strategy=auto", f"--parallelism.cp_calibration={path}"]
                                     ).parallelism)
    assert options.strategy == "auto" and options.calibration.fingerprint() == CPU_DEFAULT.fingerprint()
    with pytest.raises(ConfigError, match=r"cp_calibration: .* is not a file"):
        load_config(["--parallelism.cp_strategy=auto", f"--parallelism.cp_calibration={tmp_path / 'no.json'}"])
    with pytest.raises(ConfigError, match=r"^parallelism.cp_calibration: is only used by parallelism.cp_strategy='auto'"):
        load_config([f"--parallelism.cp_calibration={path}"])


@pytest.mark.parametrize("vocab,chunk", [
    (128_256, 512),  # Llama 3: 250.5 MiB of float32 logits a chunk (4,096 tokens would be 2 GiB)
    (151_936, 384),  # Qwen3
    (32_000, 2_048),
    (16_384, 4_096),  # exactly 256 MiB
    (320, 4_096),  # small vocabularies keep the cap
    (4_000_000, 128),  # the floor, though 128 rows then exceed the byte budget
])
def test_loss_chunk_tokens_follows_the_vocabulary_unless_set(vocab: int, chunk: int) -> None:
    config = load_config([f"--model.vocab_size={vocab}"])
    assert config.training.loss_chunk_tokens is None
    assert config.loss_chunk_tokens() == chunk
    assert load_config([f"--model.vocab_size={vocab}", "--training.loss_chunk_tokens=24"]).loss_chunk_tokens() == 24


def test_offload_params_takes_one_rank_and_refuses_a_pipeline() -> None:
    """training.offload_params is FSDP2's CPUOffloadPolicy: one rank over dp x cp takes it (FSDP2 over that rank,
    the one-GPU case), a pipeline, which holds its units between microbatches, does not."""
    load_config(["--training.offload_params=true", "--parallelism.cp=2"]).validate(world_size=2)
    load_config(["--training.offload_params=true"]).validate(world_size=1)
    with pytest.raises(ConfigError, match=r"^training.offload_params: FSDP2's CPUOffloadPolicy .* parallelism.pp = 1"):
        load_config(["--training.offload_params=true", "--parallelism.pp=2", "--parallelism.cp=2"]).validate()


def test_the_sections_spell_the_attention_librarys_choices() -> None:
    """The sections import only the standard library, so they spell the strategies, the validate modes and the
    default layout themselves: the same as `cpcompose.attention` and `cpcompose.layouts` (their owners)."""
    from typing import get_args

    from cpcompose.attention.call.options import StrategyChoice, Validate
    from cpcompose.config.sections import Parallelism, StrategyName, ValidateWhen
    from cpcompose.layouts import DEFAULT_LAYOUT

    assert get_args(StrategyName) == get_args(StrategyChoice)
    assert get_args(ValidateWhen) == get_args(Validate)
    assert Parallelism().cp_layout == DEFAULT_LAYOUT
    from cpcompose.config.sections import PipelineScheduleName
    from cpcompose.distributed import PIPELINE_SCHEDULES

    assert get_args(PipelineScheduleName) == tuple(PIPELINE_SCHEDULES)


PP = ["--parallelism.pp=2", "--model.n_layers=8", "--training.batch_size=8", "--parallelism.pp_microbatches=4"]


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.pp_schedule=Interleaved1F1B", "--model.n_layers=6"],
     r"^model.n_layers: 6 must be divisible by parallelism.pp x stages per rank = 4 \(Interleaved1F1B runs two"),
    (["--parallelism.pp_schedule=Interleaved1F1B", "--parallelism.pp_layers_per_stage=3"],
     r"^parallelism.pp_layers_per_stage: 3 does not divide model.n_layers = 8"),
    (["--parallelism.pp_schedule=LoopedBFS", "--parallelism.pp_layers_per_stage=8"],
     r"^parallelism.pp_layers_per_stage: 8 layers a stage make 1 stages, not a multiple of parallelism.pp = 2"),
    (["--parallelism.pp_schedule=1F1B", "--parallelism.pp_layers_per_stage=2"],
     r"^parallelism.pp_layers_per_stage: 2 layers a stage make 2 stages per rank, but 1F1B runs one"),
    (["--parallelism.pp_schedule=ZBVZeroBubble", "--parallelism.pp_layers_per_stage=1"],
     r"^parallelism.pp_layers_per_stage: 1 layers a stage make 4 stages per rank, but ZBVZeroBubble places exactly two"),
    (["--parallelism.pp_schedule=DualPipeV", "--parallelism.pp_microbatches=2"],
     r"^parallelism.pp_microbatches: DualPipeV needs at least as many microbatches as stages \(4 = pp 2 x 2"),
    (["--parallelism.pp_schedule=Interleaved1F1B", "--parallelism.pp_layers_per_stage=1",
      "--parallelism.pp_microbatches=4"],  # 8 stages: fewer microbatches than stages (torch would idle or hang)
     r"^parallelism.pp_microbatches: Interleaved1F1B needs at least as many microbatches as stages \(8"),
    (["--parallelism.pp_schedule=InterleavedZeroBubble", "--parallelism.pp_microbatches=5", "--training.batch_size=10"],
     r"^parallelism.pp_microbatches: InterleavedZeroBubble runs microbatches in rounds of microbatches // pp = 2"),
    (["--parallelism.pp_schedule=ZBVZeroBubble", "--parallelism.pp_microbatches=3", "--training.batch_size=6"],
     r"^parallelism.pp_microbatches: ZBVZeroBubble needs at least as many microbatches as stages"),
    (["--parallelism.pp_schedule=GPipe", "--parallelism.pp_microbatches=3"],
     r"^parallelism.pp_microbatches: 3 must divide the local batch of 8 sequences"),
    (["--parallelism.pp=1", "--parallelism.pp_layers_per_stage=2"],
     r"^parallelism.pp_layers_per_stage: cuts pipeline stages, and parallelism.pp = 1 has none"),
    (["--parallelism.pp_layers_per_stage=0"], r"^parallelism.pp_layers_per_stage: must be >= 1"),
    (["--parallelism.pp_schedule=Zigzag"], r"^parallelism.pp_schedule: .*Zigzag"),
    (["--parallelism.pp_schedule=ZBVZeroBubble", "--training.compile=true"],
     r"^training.compile: ZBVZeroBubble splits each backward"),
])
def test_pipeline_settings_a_schedule_cannot_run_are_refused_before_launch(argv: list[str], message: str) -> None:
    """Item 9 of issue 39: the layers into stages, the stages a schedule places, the microbatches it needs, named
    by key from the config's own checks (what `python -m cpcompose.train` and the dry run call before launch)."""
    with pytest.raises(ConfigError, match=message):
        resolve_config(load_config(PP + argv), 2)


@pytest.mark.parametrize("schedule, layers_per_stage, expected", [
    ("1F1B", None, [(0,), (1,)]), ("GPipe", 4, [(0,), (1,)]),
    ("Interleaved1F1B", None, [(0, 2), (1, 3)]), ("InterleavedZeroBubble", 1, [(0, 2, 4, 6), (1, 3, 5, 7)]),
    ("LoopedBFS", 2, [(0, 2), (1, 3)]), ("ZBVZeroBubble", None, [(0, 3), (1, 2)]), ("DualPipeV", 2, [(0, 3), (1, 2)]),
])
def test_stage_placement_per_schedule(schedule: str, layers_per_stage: int | None, expected: list) -> None:
    """Loop placement (rank r: r, r + pp, ...) or a V (rank r: r and 2pp - 1 - r), pp_layers_per_stage's count."""
    from cpcompose.distributed import stage_ids, stages_per_rank

    p = load_config(PP + ["--parallelism.pp_microbatches=8", f"--parallelism.pp_schedule={schedule}"] + (
        [] if layers_per_stage is None else [f"--parallelism.pp_layers_per_stage={layers_per_stage}"])).parallelism
    per_rank = stages_per_rank(p, 8)
    assert [stage_ids(schedule, 2, r, per_rank) for r in range(2)] == expected


def test_the_sections_are_pure() -> None:
    """A section holds and validates values: it imports the standard library only and reads no file (folders,
    calibrations and model configs are read by the trainer's resolution step)."""
    import ast
    import sys

    from cpcompose.config import sections

    tree = ast.parse(open(sections.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not calls & {"open", "json.load", "json.loads"} and not any(c.endswith("read_text") for c in calls), calls


def test_parallelism_ep_is_checked_by_the_degrees_and_the_family() -> None:
    """ep is folded out of dp_shard x cp (it must divide it, on the real world size), and a family without
    experts refuses it by name, before any rank starts."""
    with pytest.raises(ConfigError, match=r"^parallelism.ep: 2: llama has no experts"):
        resolve_config(load_config(["--parallelism.ep=2", "--parallelism.cp=2"]), 2)
    with pytest.raises(ConfigError, match=r"^parallelism.ep: 4 must divide dp_shard\(1\) \* cp\(2\) = 2"):
        load_config(["--parallelism.ep=4", "--parallelism.cp=2"]).validate(world_size=2)
    with pytest.raises(ConfigError, match=r"^parallelism.ep: must be > 0"):
        load_config(["--parallelism.ep=0"])
