"""Top-K compression kernels: torch path (CPU/GPU) and CuPy CUDA path; sparse wire encoding."""
from .codec import CODECS, Codec, CodecRegistry, TopKCodec, compress, decompress, ratio_to_k
from .dtypes import INDEX_DTYPES, VALUE_DTYPES, index_dtype_for
from .error_feedback import ErrorFeedback
from .sparse import SparsePayload, dense_nbytes, sparse_nbytes, topk_cost_factor
from .topk_cupy import available as cupy_available

__all__ = [
    "CODECS", "Codec", "CodecRegistry", "TopKCodec", "compress", "decompress", "ratio_to_k",
    "INDEX_DTYPES", "VALUE_DTYPES", "index_dtype_for",
    "ErrorFeedback",
    "SparsePayload", "dense_nbytes", "sparse_nbytes", "topk_cost_factor",
    "cupy_available",
]
