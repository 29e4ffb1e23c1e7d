"""One exception hierarchy for the whole engine.

Every failure a user can cause (a wrong path, a broken file, a full cache, an
unsupported block format) is a `FucinaError` subclass with a message that names the
file, key, tensor or limit involved.  The CLI catches `FucinaError` and prints its
message on one line with a non-zero exit code; anything else escaping is a bug in the
engine, and shows as a traceback on purpose.

A model file is untrusted input (docs/RELIABILITY.md): whatever its bytes, loading and
running it ends in a result or in one of these, never in another exception, a crash, a
hang or a giant allocation.  The seeded fuzzer in tests/test_fuzz_gguf.py holds that.
"""


class FucinaError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelFileError(FucinaError):
    """The path is missing, a directory, not a GGUF file, or truncated or corrupt."""


class MetadataError(FucinaError):
    """A GGUF metadata key is absent, has the wrong type, or an impossible value."""


class UnsupportedArchitecture(FucinaError):
    """`general.architecture` names a model family this engine does not implement."""


class UnsupportedFormat(FucinaError):
    """A tensor is stored in a GGML block format the engine has no kernel for."""


class ShapeMismatch(FucinaError):
    """A tensor's shape contradicts the model config read from the same file."""


class TokenizerError(FucinaError):
    """The file has no (usable) tokenizer, an id is outside the vocabulary, or a text
    holds one pre-token chunk longer than `bpe.MAX_CHUNK_BYTES`."""


class NonFiniteValues(FucinaError):
    """A forward pass produced NaN or infinity (broken weights or an impossible config).

    Raised instead of handing garbage logits to a sampler, which would pick a token
    from them without a word.
    """


class TapeMismatch(FucinaError):
    """A replayed decode step differed from the blocks it was recorded from (the
    debug check `Model.check_tape_every` / FUCINA_CHECK_TAPE): the tape was stale."""


class InvalidSequenceLength(FucinaError):
    """A forward step was asked to start at a position that is not the cache length."""


class KvCacheOverflow(FucinaError):
    """A step would write past the KV cache's capacity."""


class KvCacheHeadDimNotBlockAligned(FucinaError):
    """A q8_0 KV cache needs head_dim to be a multiple of the 32-element block."""


class ContextFull(FucinaError):
    """A chat turn does not fit in what is left of the conversation's context."""


class ModelNotFound(FucinaError):
    """A model name is neither a file on disk nor a known downloadable model."""


class DownloadError(FucinaError):
    """Fetching a model from the package registry failed, or its checksum mismatched."""
