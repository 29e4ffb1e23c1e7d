"""fucina_course: a Qwen3 inference engine built from scratch, one module per concept.

Data flows top to bottom: gguf_file -> config -> tokenizer -> quant -> weights -> ops -> kv_cache
-> model -> sampler -> chat.  The names re-exported here are the public API; everything else may
change between chapters.
"""

from .config import Config
from .errors import (
    ContextFull, DownloadError, FucinaError, InvalidSequenceLength, KvCacheHeadDimNotBlockAligned,
    KvCacheOverflow, MetadataError, ModelFileError, ModelNotFound, ShapeMismatch, TokenizerError,
    UnsupportedArchitecture, UnsupportedFormat,
)
from .gguf_file import GGUFFile, TensorInfo, open_gguf
from .tokenizer import StreamDecoder, Tokenizer, TokenType

__all__ = [
    "Config", "GGUFFile", "TensorInfo", "open_gguf", "Tokenizer", "StreamDecoder", "TokenType",
    "FucinaError", "ModelFileError", "MetadataError", "UnsupportedArchitecture", "UnsupportedFormat",
    "ShapeMismatch", "TokenizerError", "InvalidSequenceLength", "KvCacheOverflow",
    "KvCacheHeadDimNotBlockAligned", "ContextFull", "ModelNotFound", "DownloadError",
]
