"""Data for training: a synthetic long-context task (copy by default, or key/value recall) or your own
files (plain text, prompt/completion or chat records) with the model's tokenizer, batched per dp rank.

Every source maps a global sample index to a full-length sequence, deterministically and without
touching the global RNG; :class:`TokenBatcher` deals those indices to the data-parallel ranks and
remembers its position exactly. Nothing here uses process groups.
"""

from cpcompose.data.batch import IGNORE_INDEX, Batch, ParamProblem, Sample, SampleSource
from cpcompose.data.copy_task import SyntheticCopy, copy_task_problem
from cpcompose.data.corpus import build_corpus_source, build_corpus_stores, iter_documents
from cpcompose.data.documents import long_tailed_lengths
from cpcompose.data.formats import CHAT_ROLES, Document, RecordReader
from cpcompose.data.loader import TokenBatcher, build_data_source, build_token_stores, data_config_error
from cpcompose.data.pretrained import PretrainedTokenizer, has_generation_markers
from cpcompose.data.records import Record, data_files, iter_records
from cpcompose.data.supervised import SupervisedSource
from cpcompose.data.synthetic import SyntheticRecall, recall_task_problem
from cpcompose.data.text import TextSource
from cpcompose.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerChoice,
    build_tokenizer,
    config_tokenizer,
    tokenizer_choice,
)

__all__ = [
    "CHAT_ROLES", "IGNORE_INDEX", "Batch", "ByteTokenizer", "Document", "HFTokenizer", "ParamProblem",
    "PretrainedTokenizer", "Record", "RecordReader", "Sample", "SampleSource", "SupervisedSource", "SyntheticCopy",
    "SyntheticRecall", "TextSource", "TokenBatcher", "Tokenizer", "TokenizerChoice", "build_corpus_source",
    "build_data_source", "build_tokenizer", "build_corpus_stores", "build_token_stores", "config_tokenizer", "copy_task_problem",
    "data_config_error", "data_files", "has_generation_markers", "iter_documents", "iter_records",
    "long_tailed_lengths", "recall_task_problem", "tokenizer_choice",
]
