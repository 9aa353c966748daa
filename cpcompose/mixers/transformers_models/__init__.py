"""The token mixers transformers' models write in their own code (no kernel library API), under CP.

RecurrentGemma's recurrent block and RG-LRU scan, MiniMax's lightning attention, RWKV's
token shift and WKV recurrence, xLSTM's mLSTM backend, Qwen4-Exp's n-gram embedding and
PLE conv. Each is `cp(original, region, self, *the method's arguments)`; none imports
transformers (they read the module objects they are given).
"""

from cpcompose.mixers.transformers_models.lightning import cp_lightning_attention, lightning_blocks
from cpcompose.mixers.transformers_models.mlstm import cp_mlstm_backend, mlstm_backend_one_process
from cpcompose.mixers.transformers_models.ple import cp_ngram_embedding, cp_ple_short_conv
from cpcompose.mixers.transformers_models.rglru import cp_recurrent_block, cp_rglru_scan
from cpcompose.mixers.transformers_models.rwkv import cp_rwkv_block, cp_rwkv_linear_attention

__all__ = [
    "cp_lightning_attention", "cp_mlstm_backend", "cp_ngram_embedding", "cp_ple_short_conv", "cp_recurrent_block",
    "cp_rglru_scan", "cp_rwkv_block", "cp_rwkv_linear_attention", "lightning_blocks", "mlstm_backend_one_process",
]
