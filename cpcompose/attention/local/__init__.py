"""What one rank computes: the attention kernels (CUDA/CPU dispatch, the explicit fallback, CPU row
tiles, varlen routing), the block plans that say which query/key blocks meet, and the softmax merge."""

__all__: list[str] = []
