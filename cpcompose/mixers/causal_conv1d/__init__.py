"""causal-conv1d's kernel API under CP: `causal_conv1d_fn(x (batch, channels, seq), weight, bias, activation)`."""

from cpcompose.mixers.causal_conv1d.conv import cp_causal_conv1d_fn

__all__ = ["cp_causal_conv1d_fn"]
