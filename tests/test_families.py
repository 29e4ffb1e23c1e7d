"""One description of an architecture: a family's tensor table (families.py).

* A toy family registered here, in this one file (llama with its attention norm
  renamed), is written by the synthetic writer, validated and loaded, and computes what
  llama computes on the same weights, bit for bit: loading, validation and the writer
  all follow the table, and nothing else had to change.
* Each GGUF tensor name is spelled in one module of the package (families.py), so a new
  family or a renamed tensor has one home.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fucina_course import validate
from fucina_course.errors import MetadataError
from fucina_course.families import FAMILIES
from fucina_course.model import Model
from fucina_course.synth import TINY_QWEN3, write_synthetic

PACKAGE = Path(__file__).resolve().parent.parent / "fucina_course"
TOY = FAMILIES["llama"].renamed("toyllama", attention_norm="attn_pre_norm.weight")
SPEC = replace(TINY_QWEN3, arch="llama", weight_type="F32", num_layers=2, seed=3)


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toyllama", TOY)
    return TOY


def test_a_toy_family_is_its_record(tmp_path, toy_family):
    llama = Model.load(write_synthetic(SPEC, tmp_path / "llama.gguf"))
    toy_path = write_synthetic(replace(SPEC, arch="toyllama"), tmp_path / "toy.gguf")
    toy = Model.load(toy_path)
    assert "blk.1.attn_pre_norm.weight" in toy.gguf.tensors
    assert "blk.1.attn_norm.weight" not in toy.gguf.tensors
    assert toy.config.rope_style == "normal" and not toy.config.qk_norm
    ids = [5, 17, 300, 9, 42, 7]
    assert np.array_equal(toy.forward_all_logits(ids), llama.forward_all_logits(ids))


def test_the_toy_family_is_validated_by_its_table(tmp_path, toy_family):
    from fucina_course.config import Config
    from fucina_course.gguf_file import GGUFFile

    g = GGUFFile(write_synthetic(replace(SPEC, arch="toyllama"), tmp_path / "toy.gguf"))
    cfg = Config.from_gguf(g)
    names = validate.expected_tensors(cfg)
    assert "blk.0.attn_pre_norm.weight" in names and "blk.0.attn_norm.weight" not in names
    validate.check_tensors(g, cfg)
    # the same file judged by llama's table: its attention norms have the wrong name
    with pytest.raises(MetadataError, match="attn_norm.weight' is missing"):
        validate.check_tensors(g, replace(cfg, family=FAMILIES["llama"]))


def test_switches_follow_the_tables():
    got = {a: (f.qk_norm, f.qkv_bias, f.moe, f.rope_style) for a, f in FAMILIES.items()}
    assert got == {"qwen3": (True, False, False, "neox"),
                   "qwen3moe": (True, False, True, "neox"),
                   "qwen2": (False, True, False, "neox"),
                   "llama": (False, False, False, "normal")}


def _names() -> set[str]:
    """Every GGUF tensor name the tables spell, and its stem where the stem is not a
    plain word (attn_q, ffn_gate_exps; not "output", which messages use too)."""
    out = set()
    for f in FAMILIES.values():
        for t in f.model + f.layer:
            for name in filter(None, (t.name, t.bias)):
                stem = name.rsplit(".", 1)[0]
                out |= {name, stem} if "_" in stem else {name}
    return out


def _literals(path: Path):
    """The string constants of a module's code (docstrings excluded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant):
                docs.add(id(body[0].value))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs):
            yield node.value


def _spelled(value: str, name: str) -> bool:
    """`name` appears in `value` as a whole dotted/underscored token."""
    import re

    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", value) \
        is not None


def test_each_tensor_name_is_spelled_in_one_module():
    names = _names()
    where: dict[str, set[str]] = {n: set() for n in names}
    for path in PACKAGE.rglob("*.py"):
        for value in _literals(path):
            for n in names:
                if _spelled(value, n):
                    where[n].add(str(path.relative_to(PACKAGE)))
    spread = {n: sorted(m) for n, m in where.items() if m - {"families.py"}}
    assert not spread, f"tensor names spelled outside families.py: {spread}"
    assert "ffn_gate_exps" in names and "attn_k_norm" in names
