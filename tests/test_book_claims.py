"""Every number the prose interprets has a guard.

A chapter computes a number, `glue`s it, and the prose shows it with {glue:text}`name`.  Some of
those numbers are only reported ("3.2 GB", "41 tokens/s").  Others carry a claim in the words
around them ("the engine decodes 4.3 times as fast", "no step came close to a tie"): if the
machine measures something else, the number changes and the words do not, and the page
contradicts itself (seen on a Zen 4 build: "the decoder saves time" beside "0.81x the speed").

So every glued number shown in prose is classified here, per chapter:

* ``"guarded"``: the prose interprets it, and an ``assert`` in the chapter's code uses a variable
  the glued value is computed from (with a margin, for a timing: tests/test_book_timing.py);
* ``"words"``: the prose interprets it, and the glued value is itself text chosen by the
  measurement (assigned in the branches of an ``if``, by a conditional expression, or by a
  function that branches), so the words move with the number;
* ``"reported"``: the prose only shows it.

The test fails when a glued number shown in prose is not classified (a new one must be
decided), when a classified one disappears, and when a "guarded" or "words" number has lost its
guard.  The classification is a reading of the prose; the guard is checked from the code.

Two rules keep "reported" honest:

* a "reported" number must not be the one a comparing word is about: a word of ``COMPARING``
  ("faster", "fewer", "than", "smaller", ...) within ``WINDOW`` words of it, in the same
  clause (between , ; : ( ) and dashes), and nearer to it than to any other glued number
  ("{glue:text}`x` times faster" is about x; in "{glue:text}`fall`x slower at
  {glue:text}`n` positions" the word is about ``fall``).  Such a number is interpreted, so it
  is guarded or it picks its own words;
* the pages without code (the preface, the glossary, the setup page) cannot measure anything,
  so a speed claim there (``SPEED``: "faster", "slower", "speed-up", ...) fails unless
  ``BACKED`` names the chapter's glued number that holds it, and that number is guarded or
  words in its chapter.

Every page of the book is read: the chapters and book/*.md.

    python tests/test_book_claims.py      # list every glued number with its sentence
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import jupytext
import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"
CHAPTERS = BOOK / "chapters"
SHOWN = re.compile(r"\{glue:text\}`([A-Za-z_0-9]+)")
GLUE_REF = re.compile(r"\{glue:text\}`([A-Za-z_0-9]+)[^`]*`")
# Words that compare; one of them next to a number makes the number part of a claim.
COMPARING = re.compile(
    r"(?:faster|slower|quicker|more|less|fewer|than|ahead|behind|larger|smaller|bigger|"
    r"higher|lower|greater|longer|shorter|cheaper|better|worse|above|below|beats?|"
    r"outgrows?|exceeds?|outruns?)", re.I)
WINDOW = 3             # words either side of a number, inside its clause
SPEED = re.compile(r"\b(?:faster|slower|quicker|speed-?ups?|speeds? up|slows? down)\b",
                   re.I)
QUOTED = re.compile(r'"[^"]*"|\u201c[^\u201d]*\u201d|`[^`]*`')
# Speed claims on the pages without code: the words, and the chapter's glued number
# (classified "guarded" or "words" there) that holds them.
BACKED: dict[str, dict[str, tuple[str, str]]] = {
    "intro.md": {
        # chapter 14's verdict on the code edit is chosen by its measured speed-up
        "whether that makes decoding faster": ("14_speculative.md", "edit_words")},
}


def pages() -> list[Path]:
    """Every page of the book: the chapters, then book/*.md (preface, glossary, setup)."""
    return sorted(CHAPTERS.glob("[0-9][0-9]_*.md")) + sorted(BOOK.glob("*.md"))

G, W, R = "guarded", "words", "reported"
CLAIMS: dict[str, dict[str, str]] = {
    "02_tokenizer.md": {
        "n_merges": R, "n_ids": G, "n_normal": G,           # 256 + one per merge
        "n_markers": R, "n_control": R, "n_user": R, "n_unused": R, "first_unused": R,
        "n_ids_over_128": G},                                # "a multiple of 128"
    "03_forward.md": {
        "tiny_vocab": R, "f32_gap": G, "f16_gap": G,         # "the gap drops to"
        "q8_gap": G, "q8_ratio": G, "exact_rel": R,
        "stream_growth": G, "n_layers_real": R},             # "grows by a factor"
    "04_rope.md": {
        "rope_worst": G,                                     # "within ..., and not exactly"
        "slowest": R, "full_turns": G,                       # "only ... of 64 pairs"
        "spread_same": G, "n_code": R,
        "hit_right": G, "hit_wrong": G},                     # right layout guesses better
    "05_attention.md": {
        "last_token": G, "last_pos": G,                      # the same in all three prompts
        "n_heads": R, "n_kv": G,                             # "the rest read KV head 1"
        "last_of_group_0": G, "group": G, "kv_gqa": G, "kv_mha": G,   # a group-fold saving
        "next_word": R, "n_sink_layers": G, "n_layers": R,
        "v_ratio": G,                                        # "a nearly empty drawer"
        "sink_last": G, "induction_layer": G},
    "09_chat.md": {
        "turn3_reused": G, "rs_reused": G, "rs_prefilled": G, "rs_cold": R,
        "t_batch": R, "t_alone": R, "batch_words": W},
    "10_moe.md": {
        "K": R, "E": R, "total_m": R, "active_m": R, "active_share": R, "moe_ff": R,
        "group_saving": G, "group_speed": W,
        "max_load": G, "fair": G,                            # "far from even"
        "idle": R, "cells": R,
        "top1_median": G, "share_median": G,                 # "not choosing between equals"
        "machine": R,
        "vs_total": G,                                       # "decodes ... times faster"
        "size_ratio": G,                                     # "times smaller": a count
        "vs_active": R, "active_words": W, "moe_ms": R,
        "visited": G,                                        # "visits many experts"
        "pp_vs_total": W, "pp_vs_active": R,                 # words chosen by it
        "p07_bytes": G, "p07_same": R, "p03_bytes": G, "p03_same": R},
    "11_build_it.md": {
        "n_long": G,                                         # every one is the engine's
        "worst_anywhere": G,                                 # "the scores are not equal"
        "worst_top_two": R, "closest_call": R,
        "speedup": G, "byte_ratio": G,                       # "fewer bytes"
        "rate_ratio": R, "engine_gb_s": R, "ours_gb_s": R, "stream_gb_s": R,
        "speed_rest": W,                                     # chosen by rate_ratio
        "qwen3_error": G},                                   # "runs both families"
    # classified by the chapters' authors, 2026-12-02 (issue 24)
    "01_machine.md": {
        "file_mb": R, "n_params_06b": G, "heads_06b": R, "kv_heads_06b": R, "heads_05b": R,
        "kv_heads_05b": R, "ffn_share": G, "emb_share": G, "n_trained_05b": G,
        "n_params_05b": R, "n_norm_06b": G, "bits_per_param": G, "tensor_mb": R,
        "f32_mb": R, "kv_kib_06b": G, "kv_ratio": G},                  # "times less"
    "06_kv_cache.md": {
        "machine": R, "n_prompt": R, "ms_uncached": G, "ms_prefill": G, "ms_cached": R,
        "ratio": G, "eager_len": R, "eager_tokens": R, "fast_worst": G, "score_span": G,
        "vocab_size": R, "q8_ratio": R, "kl_q8_mean": R, "kl_q8_max": R, "kl_row_mean": R,
        "kl_vs_kernels": W, "q8_flips": R, "q8_steps": R, "k_err": G, "v_err": G,
        "k_spread": G, "v_spread": G, "n_layers": R, "long_ctx": R, "long_cache_share": R,
        "long_slower": G, "q8_speed": W, "q8_speed_why": W, "long_q8_ms": R,
        "long_f16_ms": R, "w06": R, "cross06": G, "qwen3_ctx": G, "kv06_full": R,
        "kv06_times": R, "kv32_full": G, "w32": G, "ours_kv": R, "ours_full": R,
        "ours_ctx": R, "ours_weights": R},
    "07_prefill_decode.md": {
        "ratio_first": G, "machine": R, "gflop_1": R, "bytes_mib": G, "intensity_1": R,
        "ridge": R, "decode_vs_ridge": W, "decode_bound": W, "tg16": R, "effective": R,
        "fraction": R, "roof_note": W, "f16_factor": R, "ctx_n": R, "ctx_cache_mib": R,
        "ctx_fall": G, "ctx_roof_fall": R, "ctx_vs_roof": W, "ctx_frac_0": R,
        "ctx_frac_n": R, "att_intensity": G, "att_vs_ridge": W, "ctx_q8": W, "fresh_ms": R,
        "tape_ms": R, "workspace_effect": W, "pp_256": G, "gflops_256": R, "pp_frac": R,
        "intensity_256": R, "pp_vs_ridge": W, "batch_gain": G, "batch_8": R,
        "per_stream_slow": G, "decode_ceiling": R, "packed_words": W},
    "08_sampling.md": {
        "p_first": G, "top90": G, "n_whispers": G, "n_lines": R, "took2": R, "p_took2": R,
        "p_other2": R, "other2": R, "second_line_words": W, "gap2": R, "prefill_words": W,
        "drift": R, "gap_words": W, "retok_words": W, "p_again2": G, "p_again1": G,
        "pbest15": G, "pbest03": G, "n07": G, "n15": G, "tail07": R, "tail07_words": W,
        "tail10": R, "tail15": R, "tail15_words": W, "whole15": G, "cost_window": R,
        "cost_whole": R, "p_rp13": R, "rp13_words": W, "p_pp15": R, "pp15_words": W,
        "order_ours": G, "order_llama": G, "sample_us": G, "step_ms": G},
    "12_run_it.md": {
        "logits_verdict": W},
    "13_serve_it.md": {
        "batch_bits": W, "n_allowed": G, "p_removed": R, "serve_gain": R, "gain_words": W,
        "beyond_words": W, "serve_vs_lockstep": R, "versus_words": W, "median_p": G,
        "unsure_p": G, "unsure_token": R, "unsure_alt": R},
    "15_bigger_than_memory.md": {
        "token_share": R, "hit_full": G, "hit_eighth": R, "routing_words": W,
        "read_ratio": G, "ahead_words": W, "waits_saved": R, "lookahead_rate": G,
        "p07_saves": G, "share_random": R, "share_spread": G, "hit_eighth_random": R,
        "p07_kl": R, "pager_words": W},
    "14_speculative.md": {
        "cost_words": W, "cost_8": R, "roof_share_1": R, "curve_words": W,
        "share_sentence": W, "tile_words": W, "ridge_rows": R,
        "edit_tokens": R, "edit_steps": R, "batched_gap": R, "gap_words": W, "accept_rate": R,
        "edit_words": W, "edit_acceptance": R, "prose_acceptance": R, "prose_words": W,
        "prose_gain": R, "prose_why": W, "my_tokens": R, "my_steps": G},
}


@dataclass
class Chapter:
    """What the checks need from one chapter: its glue calls, asserts, branches and prose."""

    glued: dict[str, set[str]] = field(default_factory=dict)   # name -> variables it uses
    asserted: set[str] = field(default_factory=set)            # variables some assert uses
    chosen: set[str] = field(default_factory=set)              # variables set in branches
    shown: dict[str, str] = field(default_factory=dict)        # name -> its sentence
    compared: dict[str, str] = field(default_factory=dict)     # name -> comparing word
    speed: list[str] = field(default_factory=list)             # sentences claiming speed
    has_code: bool = False


# names that say nothing about which value is used: builtins and the usual modules
_NEUTRAL = set(dir(builtins)) | {"np", "math", "statistics", "viz"}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _names(node: ast.AST) -> set[str]:
    """The values an expression reads, as dotted names (`tok.vocab_size`, not just `tok`:
    an assert about one attribute of the tokenizer guards no other)."""
    out: set[str] = set()

    def visit(n: ast.AST) -> None:
        name = _dotted(n)
        if name is not None:
            if name.split(".")[0] not in _NEUTRAL:
                out.add(name)
            return
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    return out


def _assigned(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                out |= _names(t)
    return out


def _is_glue(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "glue" \
        and bool(node.args)


def sentences(markdown: str):
    """The sentences of some markdown: paragraphs and list items first, then sentence ends.
    Fenced blocks (code, directives) are left out."""
    prose = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.M | re.S)
    for part in re.split(r"\n\s*\n|\n(?=\s*(?:[-*+]|\d+\.) )", prose):
        for sentence in re.split(r"(?<=[.:;!?])\s+(?=[A-Z{(*])", part):
            if sentence.strip():
                yield " ".join(sentence.split())


def comparing_words(sentence: str) -> dict[str, str]:
    """{glued name: the comparing word about it} for one sentence: each comparing word is
    about the nearest glued number of its clause, if one is within WINDOW words (on a tie,
    the one before it: "{x} times faster than {y}" compares x; "than {y}" then compares y)."""
    found: dict[str, str] = {}
    marked = GLUE_REF.sub(lambda m: f" \0{m.group(1)}\0 ", sentence)
    for clause in re.split(r"[,;:()\u2013\u2014]|\s-\s", marked):
        words = re.findall(r"\0\w+\0|[\w'-]+", clause)
        numbers = [i for i, w in enumerate(words) if w.startswith("\0")]
        for i, word in enumerate(words):
            if not COMPARING.fullmatch(word):
                continue
            near = [(abs(i - j), j > i, j) for j in numbers if abs(i - j) <= WINDOW]
            if near:
                found.setdefault(words[min(near)[2]].strip("\0"), word)
    return found


def read_chapter(path: Path) -> Chapter:
    ch = Chapter()
    text = path.read_text(encoding="utf-8")
    if text.startswith("---\njupytext:"):
        cells = jupytext.read(path).cells
    else:                                       # a plain page: all of it is prose
        cells = [SimpleNamespace(cell_type="markdown", source=text)]
    for cell in cells:
        if cell.cell_type == "markdown":
            for sentence in sentences(cell.source):
                for name in SHOWN.findall(sentence):
                    ch.shown.setdefault(name, sentence)
                for name, word in comparing_words(sentence).items():
                    ch.compared.setdefault(name, word)
                if SPEED.search(QUOTED.sub("", sentence)):   # a quoted word is not a claim
                    ch.speed.append(sentence)
            continue
        if cell.cell_type != "code":
            continue
        ch.has_code = True
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if _is_glue(node) and isinstance(node.args[0], ast.Constant):
                value = node.args[1] if len(node.args) > 1 else ast.Constant(None)
                ch.glued[node.args[0].value] = _names(value)
                if any(isinstance(n, ast.IfExp) for n in ast.walk(value)):
                    ch.chosen |= _names(value)          # words picked right in the call
            elif isinstance(node, ast.For) and isinstance(node.iter, (ast.List, ast.Tuple)) \
                    and any(_is_glue(n) for n in ast.walk(node)):
                for item in node.iter.elts:             # for name, value in [("a", a), ...]
                    if isinstance(item, ast.Tuple) and isinstance(item.elts[0], ast.Constant):
                        ch.glued[item.elts[0].value] = set().union(*map(_names, item.elts[1:]))
            elif isinstance(node, ast.Assert):
                ch.asserted |= _names(node.test)
            elif isinstance(node, ast.If):
                ch.chosen |= _assigned(node)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.IfExp):
                ch.chosen |= _assigned(node)
            elif isinstance(node, ast.FunctionDef) and any(
                    isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(node)):
                ch.chosen.add(node.name)            # a function that picks the words
    return ch


def problems(chapter: str, ch: Chapter, claims: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(set(ch.shown) - set(claims)):
        out.append(f"{chapter}: {name!r} is shown in prose but not classified "
                   f"(guarded/words/reported): {ch.shown[name]!r}")
    for name in sorted(set(claims) - set(ch.shown)):
        out.append(f"{chapter}: {name!r} is classified but no longer shown in prose")
    for name, kind in sorted(claims.items()):
        if name not in ch.shown:
            continue
        uses = ch.glued.get(name)
        if uses is None:
            out.append(f"{chapter}: {name!r} is shown but never glued")
        elif kind == G and not uses & ch.asserted:
            out.append(f"{chapter}: {name!r} is interpreted by the prose but no assert uses "
                       f"{sorted(uses)}: {ch.shown[name]!r}")
        elif kind == W and not uses & ch.chosen:
            out.append(f"{chapter}: {name!r} should be words chosen by the measurement, but "
                       f"none of {sorted(uses)} is assigned in a branch")
        elif kind == R and name in ch.compared:
            out.append(f"{chapter}: {name!r} is classified 'reported', but the prose "
                       f"compares it ({ch.compared[name]!r}): guard it with an assert, or "
                       f"let the number choose the words: {ch.shown[name]!r}")
    return out


def unbacked_speed_claims(page: str, ch: Chapter, backed: dict[str, tuple[str, str]],
                          claims: dict[str, dict[str, str]]) -> list[str]:
    """A page without code cannot measure: its speed claims must point at a chapter's
    guarded (or measurement-worded) number."""
    if ch.has_code:
        return []
    out = []
    for sentence in ch.speed:
        holders = [(words, held) for words, held in backed.items() if words in sentence]
        if not holders:
            out.append(f"{page}: a speed claim on a page without code: {sentence!r} "
                       "(say it where it is measured, or add it to BACKED)")
        for words, (chapter, name) in holders:
            if claims.get(chapter, {}).get(name) not in (G, W):
                out.append(f"{page}: {words!r} is backed by {chapter}'s {name!r}, which is "
                           "not classified 'guarded' or 'words' there")
    return out


@pytest.mark.parametrize("page", [p.name for p in pages()])
def test_every_interpreted_number_has_its_guard(page):
    path = next(p for p in pages() if p.name == page)
    ch = read_chapter(path)
    found = problems(page, ch, CLAIMS.get(page, {}))
    found += unbacked_speed_claims(page, ch, BACKED.get(page, {}), CLAIMS)
    assert not found, "\n".join(found)


def _toy(tmp_path: Path, code: str, prose: str) -> Chapter:
    path = tmp_path / "99_toy.md"
    path.write_text("---\njupytext:\n  text_representation:\n    extension: .md\n"
                    "    format_name: myst\n---\n\n# Toy\n\n```{code-cell} ipython3\n"
                    f"{code}\n```\n\n{prose}\n")
    return read_chapter(path)


def test_the_checks_can_fail(tmp_path):
    prose = "Ours is {glue:text}`speedup:.1f` times as fast."
    bare = _toy(tmp_path, "speedup = 4.0\nglue('speedup', speedup)", prose)
    assert problems("toy", bare, {}) and "not classified" in problems("toy", bare, {})[0]
    assert "no assert uses" in problems("toy", bare, {"speedup": G})[0]
    assert not problems("toy", bare, {"speedup": R})
    guarded = _toy(tmp_path, "speedup = 4.0\nassert speedup > 1  # margin\n"
                   "glue('speedup', speedup * 1)", prose)
    assert not problems("toy", guarded, {"speedup": G})
    words = "Ours is {glue:text}`verdict`."
    fixed = _toy(tmp_path, "verdict = 'fast'\nglue('verdict', verdict)", words)
    assert "assigned in a branch" in problems("toy", fixed, {"verdict": W})[0]
    chosen = _toy(tmp_path, "x = 2\nverdict = 'fast' if x > 1 else 'slow'\n"
                  "glue('verdict', verdict)", words)
    assert not problems("toy", chosen, {"verdict": W})
    gone = _toy(tmp_path, "x = 1", "No numbers.")
    assert "no longer shown" in problems("toy", gone, {"speedup": R})[0]


def test_a_reported_number_in_a_comparison_fails(tmp_path):
    code = "speedup = 4.0\nn = 9\nglue('speedup', speedup)\nglue('n', n)"
    for prose in ("Ours is {glue:text}`speedup:.1f` times faster.",
                  "It decodes faster than the engine's {glue:text}`speedup:.1f` tokens/s.",
                  "Batching made it {glue:text}`speedup:.1f`x slower, as expected.",
                  "The cache keeps {glue:text}`speedup:.0f` times less: 2 KV heads."):
        found = problems("toy", _toy(tmp_path, code, prose), {"speedup": R})
        assert found and "compares it" in found[0], prose
    # the comparing word is about the nearest number; reporting beside it is fine
    near = ("Decode is {glue:text}`speedup:.1f`x slower at {glue:text}`n` positions, "
            "and a model of more than half a billion parameters fits in {glue:text}`n` MB.")
    ch = _toy(tmp_path, code + "\nassert speedup > 1  # margin", near)
    assert ch.compared == {"speedup": "slower"}
    assert not problems("toy", ch, {"speedup": G, "n": R})
    assert not problems("toy", _toy(tmp_path, code, "It ran {glue:text}`speedup:.1f` "
                                    "times as many tokens, at {glue:text}`n` ms each."),
                        {"speedup": R, "n": R})


def test_a_speed_claim_on_a_page_without_code_fails(tmp_path):
    page = tmp_path / "preface.md"
    page.write_text("# Preface\n\nThe same tokens, while decoding faster.\n\n"
                    "```bash\nfucina bench  # faster\n```\n\nA \"faster\" is checked.\n")
    ch = read_chapter(page)
    assert not ch.has_code and len(ch.speed) == 1   # not the fence, not the quoted word
    assert "page without code" in unbacked_speed_claims("preface.md", ch, {}, {})[0]
    backed = {"while decoding faster": ("14_x.md", "gain_words")}
    assert not unbacked_speed_claims("preface.md", ch, backed, {"14_x.md": {"gain_words": W}})
    assert "not classified" in unbacked_speed_claims("preface.md", ch, backed,
                                                     {"14_x.md": {"gain_words": R}})[0]


if __name__ == "__main__":
    for path in pages():
        ch = read_chapter(path)
        claims = CLAIMS.get(path.name, {})
        for name, sentence in ch.shown.items():
            guard = "A" if ch.glued.get(name, set()) & ch.asserted else \
                "W" if ch.glued.get(name, set()) & ch.chosen else "-"
            print(f"{path.name[:2]} {claims.get(name, '?'):8} {guard} {name:22} "
                  f"{sentence[:300]}", file=sys.stdout)
