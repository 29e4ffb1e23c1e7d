"""bench/arm_decode_estimate.py: the bytes a decoded token reads, against gguf-py's own
count of the file's tensors."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from gguf import GGUFReader

from fucina_course.synth import TINY_QWEN3, cached_synthetic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from arm_decode_estimate import bytes_per_token  # noqa: E402


def sizes(path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}


def test_tied_embeddings_are_read_whole_as_the_output_matrix():
    path = cached_synthetic(TINY_QWEN3)
    assert "output.weight" not in sizes(path)
    assert bytes_per_token(str(path)) == sum(sizes(path).values())


def test_untied_embeddings_cost_one_row():
    path = cached_synthetic(replace(TINY_QWEN3, tied_embeddings=False, name="tiny-untied"))
    s = sizes(path)
    row = s["token_embd.weight"] // TINY_QWEN3.vocab_size
    assert bytes_per_token(str(path)) == sum(s.values()) - s["token_embd.weight"] + row
