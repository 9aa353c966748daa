"""Single-process tests of the reference Llama and its pipeline split."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cpcompose.models import (
    Llama,
    LlamaConfig,
    apply_rope,
    rope_cos_sin,
    split_llama_for_pipeline,
    split_llama_for_stages,
)

# float32 on CPU. Where two runs take different op orders (shifted positions round
# cos/sin differently, a prefix changes matmul shapes) the observed error is ~1e-7;
# 1e-4 leaves room for other BLAS builds while staying far below the ~0.1 change
# that wrong positions cause. Runs with identical op orders must match exactly.
ATOL = RTOL = 1e-4


def _config(**overrides: object) -> LlamaConfig:
    base = dict(
        vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48, max_seq_len=64
    )
    base.update(overrides)
    return LlamaConfig(**base)  # type: ignore[arg-type]


def _model(seed: int = 0, **overrides: object) -> Llama:
    model = Llama(_config(**overrides))
    model.init_weights(seed=seed)
    return model


def _tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_shapes_and_gqa_layout() -> None:
    model = _model()
    assert model(_tokens()).shape == (2, 16, 97)
    head_dim = 32 // 4
    assert model.layers["0"].attention.wq.weight.shape == (4 * head_dim, 32)
    assert model.layers["0"].attention.wk.weight.shape == (2 * head_dim, 32)
    assert list(model.layers) == ["0", "1", "2", "3"]


def test_attention_calls_sdpa_once_with_unrepeated_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CP style relies on one interceptable SDPA call per layer with n_kv_heads K/V heads."""
    calls: list[tuple[torch.Size, torch.Size, dict[str, object]]] = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append((q.shape, k.shape, kwargs))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    _model()(_tokens(seq=8))
    assert len(calls) == 4
    q_shape, k_shape, kwargs = calls[0]
    assert q_shape == (2, 4, 8, 8) and k_shape == (2, 2, 8, 8)
    assert kwargs == {"is_causal": True, "enable_gqa": True}


def test_gqa_matches_mha_with_repeated_kv_heads() -> None:
    """A GQA model equals an MHA model whose K/V projections repeat each KV head."""
    gqa = _model()
    mha = Llama(_config(n_kv_heads=4))
    state = gqa.state_dict()
    head_dim = 8
    for layer_id in gqa.layers:
        for proj in ("wk", "wv"):
            key = f"layers.{layer_id}.attention.{proj}.weight"
            state[key] = state[key].view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    tokens = _tokens()
    torch.testing.assert_close(gqa(tokens), mha(tokens), atol=ATOL, rtol=RTOL)


def test_rope_uses_given_positions_not_token_index() -> None:
    head_dim, theta = 8, 10000.0
    x = torch.randn(2, 3, 10, head_dim)
    cos, sin = rope_cos_sin(torch.arange(10), head_dim=head_dim, theta=theta)
    full = apply_rope(x, cos=cos, sin=sin)
    # A CP rank holding chunks {1, 4} of 5 passes their global positions.
    positions = torch.tensor([2, 3, 8, 9])
    cos_sub, sin_sub = rope_cos_sin(positions, head_dim=head_dim, theta=theta)
    subset = apply_rope(x[:, :, positions], cos=cos_sub, sin=sin_sub)
    torch.testing.assert_close(subset, full[:, :, positions], atol=0, rtol=0)
    # The token at position 7 rotates the same whether it sits at index 0 or 7.
    cos7, sin7 = rope_cos_sin(torch.tensor([7]), head_dim=head_dim, theta=theta)
    torch.testing.assert_close(apply_rope(x[:, :, 7:8], cos=cos7, sin=sin7), full[:, :, 7:8], atol=0, rtol=0)
    # Batched positions give each row its own rotation.
    batched = torch.stack([torch.arange(10), torch.arange(10)])
    cos_b, sin_b = rope_cos_sin(batched, head_dim=head_dim, theta=theta)
    assert cos_b.shape == (2, 1, 10, head_dim // 2)
    torch.testing.assert_close(apply_rope(x, cos=cos_b, sin=sin_b), full, atol=0, rtol=0)


def test_model_honours_position_ids() -> None:
    model = _model()
    with torch.no_grad():  # std-0.02 init gives near-uniform attention; sharpen it so RoPE shows.
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(20)
            layer.attention.wk.weight.mul_(20)
    tokens = _tokens()
    reference = model(tokens)
    torch.testing.assert_close(model(tokens, torch.arange(16)), reference, atol=0, rtol=0)
    torch.testing.assert_close(model(tokens, torch.arange(16).expand(2, 16)), reference, atol=0, rtol=0)
    # RoPE scores depend only on relative position, so a uniform shift changes
    # nothing beyond rounding, while a non-uniform one changes the output.
    torch.testing.assert_close(model(tokens, torch.arange(16) + 40), reference, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(model(tokens, torch.arange(16) * 2), reference, atol=1e-3)
    # Causal: a prefix with its own positions reproduces the prefix of the full run.
    torch.testing.assert_close(model(tokens[:, :6], torch.arange(6)), reference[:, :6], atol=ATOL, rtol=RTOL)


def test_meta_construction_matches_direct_and_is_deterministic() -> None:
    direct = _model(seed=3)
    with torch.device("meta"):
        lazy = Llama(_config())
    with pytest.raises(ValueError, match="to_empty"):
        lazy.init_weights(seed=3)
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=3)
    for (name, expected), (_, actual) in zip(direct.named_parameters(), lazy.named_parameters(), strict=True):
        torch.testing.assert_close(actual, expected, atol=0, rtol=0, msg=name)
    other_seed = _model(seed=4)
    assert not torch.equal(other_seed.output.weight, direct.output.weight)


def test_pipeline_stages_compose_to_full_model() -> None:
    full = _model()
    stages = [split_llama_for_pipeline(copy.deepcopy(full), num_stages=2, stage_index=i) for i in range(2)]
    assert list(stages[0].layers) == ["0", "1"] and stages[0].output is None and stages[0].norm is None
    assert list(stages[1].layers) == ["2", "3"] and stages[1].tok_embeddings is None
    tokens, positions = _tokens(), torch.arange(16)
    hidden = stages[0](tokens, positions)
    assert hidden.shape == (2, 16, 32)
    torch.testing.assert_close(stages[1](hidden, positions), full(tokens, positions), atol=0, rtol=0)


def test_pipeline_stage_initialised_alone_matches_full_model() -> None:
    """Per-FQN seeding: a stage built on meta and initialised alone equals the full model's layers."""
    full = _model(seed=5)
    with torch.device("meta"):
        stage = split_llama_for_pipeline(Llama(_config()), num_stages=4, stage_index=3)
    stage.to_empty(device="cpu")
    stage.init_weights(seed=5)
    full_params = dict(full.named_parameters())
    names = [name for name, _ in stage.named_parameters()]
    assert "layers.3.attention.wq.weight" in names and "output.weight" in names
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param, full_params[name], atol=0, rtol=0, msg=name)


def test_a_rank_of_a_v_schedule_keeps_one_model_with_full_names_and_a_view_per_stage() -> None:
    """Stages 0 and 3 of 4 (rank 0 of a V at pp = 2): one model holding both stages' modules under the full
    model's FQNs, and two views sharing those modules; the four views of both ranks run the full model."""
    full = _model()
    rank0, views0 = split_llama_for_stages(copy.deepcopy(full), num_stages=4, stage_ids=(0, 3))
    rank1, views1 = split_llama_for_stages(copy.deepcopy(full), num_stages=4, stage_ids=(1, 2))
    assert list(rank0.layers) == ["0", "3"] and rank0.tok_embeddings is not None and rank0.output is not None
    assert list(rank1.layers) == ["1", "2"] and rank1.tok_embeddings is None and rank1.output is None
    assert {n for n, _ in rank0.named_parameters()} | {n for n, _ in rank1.named_parameters()} == \
        {n for n, _ in full.named_parameters()}
    assert views0[0].layers["0"] is rank0.layers["0"] and views0[1].output is rank0.output
    assert views0[0].output is None and views0[1].tok_embeddings is None and list(views0[1].layers) == ["3"]
    tokens, positions = _tokens(), torch.arange(16)
    hidden = tokens
    for view in (views0[0], views1[0], views1[1], views0[1]):
        hidden = view(hidden, positions)
    torch.testing.assert_close(hidden, full(tokens, positions), atol=0, rtol=0)
    with pytest.raises(ValueError, match="distinct stage indices"):
        split_llama_for_stages(_model(), num_stages=4, stage_ids=(0, 0))


def test_pipeline_split_errors() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        split_llama_for_pipeline(_model(), num_stages=3, stage_index=0)
    with pytest.raises(ValueError, match="stage_index"):
        split_llama_for_pipeline(_model(), num_stages=2, stage_index=2)
    with pytest.raises(ValueError, match="uncut"):
        split_llama_for_pipeline(split_llama_for_pipeline(_model(), num_stages=2, stage_index=1),
                                 num_stages=2, stage_index=1)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dim": 30}, "model.dim"),
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"n_layers": 0}, "model.n_layers"),
        ({"dim": 12, "n_heads": 4}, "head_dim"),
        ({"norm_eps": 0.0}, "model.norm_eps"),
    ],
)
def test_bad_config_names_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _config(**overrides)


def test_sequence_longer_than_max_seq_len_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        _model(max_seq_len=8)(_tokens(seq=9))
