"""Data for training: a synthetic long-context task (copy by default, or key/value recall) or your own
text, batched per dp rank.

Every source maps a global sample index to a full-length sequence, deterministically and without
touching the global RNG; :class:`TokenBatcher` deals those indices to the data-parallel ranks and
remembers its position exactly. Nothing here uses process groups.
"""

from cpcompose.data.batch import IGNORE_INDEX, Batch, ParamProblem, Sample, SampleSource
from cpcompose.data.copy_task import SyntheticCopy, copy_task_problem
from cpcompose.data.loader import TokenBatcher, build_data_source
from cpcompose.data.documents import document_cu_seqlens, long_tailed_lengths, mask_document_crossings
from cpcompose.data.synthetic import SyntheticRecall, recall_task_problem
from cpcompose.data.text import TextSource, read_documents
from cpcompose.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX", "Batch", "ByteTokenizer", "HFTokenizer", "ParamProblem", "Sample", "SampleSource", "SyntheticCopy",
    "SyntheticRecall", "TextSource", "TokenBatcher", "Tokenizer", "build_data_source", "build_tokenizer",
    "copy_task_problem", "document_cu_seqlens", "long_tailed_lengths", "mask_document_crossings", "read_documents",
    "recall_task_problem",
]
