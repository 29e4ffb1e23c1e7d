"""The reader's workbook (`fucina course init / check / ask / solution`).

Every check must pass on the book's course code and fail on a broken copy of it: a check that
cannot fail is a defect, so each one here is run against a planted mistake (the mutations
below, each one a slip a learner could make). A check also has to blame the right function:
a broken `rms_norm` fails `rms_norm`, not the forward step that calls it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fucina_course import workbook
from fucina_course.workbook_checks import CHECKS, Fixtures, run, run_one

REFERENCE = workbook.REFERENCE


@pytest.fixture(scope="module")
def fx():
    return Fixtures()


def fucina(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fucina_course", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def copy_of_reference(tmp_path: Path) -> Path:
    target = tmp_path / "course"
    target.mkdir()
    for path in REFERENCE.glob("*.py"):
        shutil.copy(path, target / path.name)
    return target


def test_every_saved_definition_has_a_check_and_the_book_passes_them(fx):
    saved = {(c.module, name) for c in workbook.chapters()
             for name in workbook.definitions((REFERENCE / f"{c.module}.py").read_text())}
    assert saved == set(CHECKS)
    results = run(REFERENCE, workbook.chapters(), fx)
    failed = [(r.chapter.module, r.name, r.detail) for r in results if r.status != "passed"]
    assert not failed
    assert len(results) == len(saved)


# (module, text in the book's version, replacement, the definition that must fail)
MUTATIONS = [
    ("forward", "astype(np.float32) * w", "astype(np.float32)", "rms_norm"),
    ("forward", "a * sin + b * cos", "a * sin - b * cos", "rope"),
    ("forward", "scores[:, future] = -np.inf", "pass", "attention"),
    ("tokenizer", "rank, i = min(", "rank, i = max(", "bpe_encode"),
    ("tokenizer", "0x21 <= b <= 0x7E", "0x20 <= b <= 0x7E", "gpt2_byte_map"),
    ("attention", "scores[future] = -np.inf", "pass", "attention_head"),
    ("attention", "kv = h // group", "kv = h % k.shape[1]", "grouped_attention"),
    ("attention", "np.exp(scores - scores.max(axis=-1, keepdims=True))", "np.exp(scores)",
     "softmax"),
    ("kv_cache", "self.len = min(self.len, max(0, keep))", "self.len = max(0, keep - 1)",
     "CourseKvCache"),
    ("sampling", "np.float32(top_p))) + 1", "np.float32(top_p)))", "course_distribution"),
    ("sampling", "u * probs.sum()", "u", "course_draw"),
    ("chat", '"<|im_start|>assistant\\n"', '"<|im_start|>assistant"', "course_chatml"),
    ("moe", "weights = weights / weights.sum(axis=1, keepdims=True)", "pass",
     "course_route"),
    ("build_it", "q = rms_norm(q, w[\"attn_q_norm.weight\"], eps)", "pass", "CourseModel"),
    ("build_it", "if token in stop:\n            break", "pass", "generate"),
    ("build_it", "for ids, _, cache in segments:\n            cache.advance(len(ids))",
     "segments[0][2].advance(len(segments[0][0]))", "CourseModel"),
    ("speculative", "range(len(tokens) - n - 1, -1, -1)", "range(len(tokens) - n)",
     "course_lookup"),
    ("speculative", "residual = np.maximum(p - q, 0.0)", "residual = p", "course_accept"),
    ("speculative", "cache.truncate(base + 1 + k)", "cache.truncate(base + k)",
     "course_speculative_generate"),
    ("machine", 'key.strip() == "model name"', 'key.strip() == "vendor_id"',
     "cpu_description"),
    ("machine", "{threads} threads", "{os.cpu_count()} threads", "machine_label"),
    ("tokenizer", "return QWEN2_PATTERN.findall(text)", 'return text.split(" ")',
     "pretokenize"),
    ("forward", ".reshape(t.shape[::-1])", ".reshape(t.shape)", "float_weights"),
    ("forward", "np.exp(-gate)", "np.exp(gate)", "swiglu"),
    ("forward", 'x = x + ffn @ w["ffn_down.weight"].T', 'x = ffn @ w["ffn_down.weight"].T',
     "forward"),
    ("kv_cache", "range(n // 256)", "range(n // 512)", "filled_cache"),
    ("moe", "out[row] += w * ffn", "out[row] = w * ffn", "course_moe"),
    ("build_it", 'rope_theta=gguf.get_float(f"{arch}.rope.freq_base")',
     "rope_theta=10000.0", "course_config"),
    ("build_it", '("<|im_end|>", "<|endoftext|>")', '("<|im_end|>",)', "CourseTokenizer"),
    ("build_it", "y if bias is None else y + bias", "y", "linear"),
    ("build_it", 'course_chatml([{"role": "user", "content": question}])', "question", "ask"),
]


def test_every_check_catches_a_planted_mistake():
    assert {(m, name) for m, _, _, name in MUTATIONS} == set(CHECKS)


@pytest.mark.parametrize("module, old, new, name", MUTATIONS,
                         ids=[f"{m[0]}.{m[3]}" for m in MUTATIONS])
def test_a_planted_mistake_fails_its_check(tmp_path, fx, module, old, new, name):
    reader = copy_of_reference(tmp_path)
    path = reader / f"{module}.py"
    source = path.read_text()
    assert source.count(old) == 1, f"the mutation no longer matches {module}.py"
    path.write_text(source.replace(old, new))
    chapter = workbook.select([module])[0]
    result = run_one(reader, chapter, name, fx)
    assert result.status == "failed", result
    assert result.detail


def test_a_mistake_is_blamed_on_its_function_only(tmp_path, fx):
    """rms_norm without its weight: rms_norm fails; the forward steps that call it are
    checked with the book's rms_norm, and pass."""
    reader = copy_of_reference(tmp_path)
    path = reader / "forward.py"
    path.write_text(path.read_text().replace("astype(np.float32) * w", "astype(np.float32)"))
    results = {(r.chapter.module, r.name): r.status
               for r in run(reader, workbook.select(["3", "11"]), fx)}
    assert results.pop(("forward", "rms_norm")) == "failed"
    assert set(results.values()) == {"passed"}, results


def test_stubs_keep_signatures_and_docstrings_and_raise(tmp_path):
    workbook.init(tmp_path / "T")
    for chapter in workbook.chapters():
        stub = (tmp_path / "T" / f"{chapter.module}.py").read_text()
        reference = (REFERENCE / f"{chapter.module}.py").read_text()
        assert workbook.definitions(stub) == workbook.definitions(reference)
        assert not any(workbook.implemented(stub).values())
        assert set(workbook.implemented(reference).values()) == {True}
    kv = (tmp_path / "T" / "kv_cache.py").read_text()
    assert "def append_layer(self, layer: int, k, v) -> None:" in kv
    assert '"""Write a step\'s n rows at len .. len+n-1.  Does NOT move len."""' in kv
    assert kv.count('raise NotImplementedError("') == 9     # 8 methods + filled_cache


def test_cli_init_then_check_lists_everything_as_not_implemented(tmp_path):
    made = fucina("course", "init", "T", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    again = fucina("course", "init", "T", cwd=tmp_path)            # never overwrites
    assert again.returncode == 1 and "nothing was written" in again.stderr
    checked = fucina("course", "check", "--dir", "T", cwd=tmp_path)
    assert checked.returncode == 1
    assert "Traceback" not in checked.stderr + checked.stdout
    lines = [line for line in checked.stdout.splitlines() if line.startswith("  ")]
    assert len(lines) == len(CHECKS)
    assert all("todo" in line and "(not implemented)" in line for line in lines)


def test_cli_check_passes_on_the_book_and_names_a_broken_function(tmp_path):
    reader = copy_of_reference(tmp_path)
    ok = fucina("course", "check", "--dir", str(reader))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{len(CHECKS)} passed" in ok.stdout
    path = reader / "forward.py"
    path.write_text(path.read_text().replace("astype(np.float32) * w", "astype(np.float32)"))
    bad = fucina("course", "check", "03", "--dir", str(reader))
    assert bad.returncode == 1
    assert [line.split()[1] for line in bad.stdout.splitlines()
            if line.startswith("  FAIL")] == ["rms_norm:"]


def test_check_reports_a_syntax_error_and_an_exception_in_one_line(tmp_path, fx):
    reader = copy_of_reference(tmp_path)
    (reader / "chat.py").write_text("def course_chatml(messages:\n")
    source = (reader / "sampling.py").read_text()
    (reader / "sampling.py").write_text(source.replace(
        'return int(np.searchsorted(np.cumsum(probs), u * probs.sum()))',
        'return int(probs[u])'))
    results = {r.name: r for r in run(reader, workbook.select(["chat", "sampling"]), fx)}
    assert results["course_chatml"].status == "failed"
    assert "chat.py line 1" in results["course_chatml"].detail
    draw = results["course_draw"]
    assert draw.status == "failed" and "IndexError" in draw.detail
    assert "(sampling.py:" in draw.detail                 # where, in the reader's file


def test_the_readers_own_helper_module_can_be_imported(tmp_path, fx):
    reader = copy_of_reference(tmp_path)
    (reader / "helpers.py").write_text("def silu(x):\n    return x / (1 + np.exp(-x))\n\n"
                                       "import numpy as np\n")
    path = reader / "forward.py"
    path.write_text(path.read_text().replace(
        "    return gate / (1 + np.exp(-gate)) * up",
        "    from course.helpers import silu\n    return silu(gate) * up"))
    assert run_one(reader, workbook.select(["3"])[0], "swiglu", fx).status == "passed"


def test_an_endless_loop_fails_its_check_after_the_timeout(tmp_path, fx):
    reader = copy_of_reference(tmp_path)
    path = reader / "chat.py"
    path.write_text(path.read_text().replace(
        '    if not messages or messages[0]["role"] != "system":',
        '    while True:\n        pass\n    if not messages or messages[0]["role"] != "system":'))
    result = run_one(reader, workbook.select(["chat"])[0], "course_chatml", fx, timeout=1)
    assert result.status == "failed"
    assert "still running after 1 s" in result.detail and "(chat.py:" in result.detail


def test_hostile_arguments_are_one_line_errors(tmp_path):
    workbook.init(tmp_path / "T")
    (tmp_path / "afile").write_text("")
    cases = [("course", "ask", "a" * 2_001, "--dir", "T"),
             ("course", "ask", "hi", "--dir", "T", "--temp", "nan"),
             ("course", "ask", "hi", "--dir", "T", "--max-tokens", "0"),
             ("course", "ask", "hi", "--dir", "T", "--max-tokens", "10000000000"),
             ("course", "ask", "hi", "--dir", "T", "--seed", "-1"),
             ("course", "ask", "hi", "--dir", "missing"),
             ("course", "check", "--dir", "T", "--timeout", "0"),
             ("course", "init", "afile"),
             ("course", "solution", "99")]
    for args in cases:
        done = fucina(*args, cwd=tmp_path)
        assert done.returncode == 1, (args, done.stderr)
        assert done.stderr.startswith("fucina: error: ") and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


def test_chapters_are_named_by_number_or_module():
    assert workbook.select(["3"]) == workbook.select(["03"]) == workbook.select(["forward"])
    with pytest.raises(workbook.WorkbookError, match="no chapter '4'"):
        workbook.select(["4"])                 # RoPE saves its code in chapter 3's module
    bad = fucina("course", "check", "nope", "--dir", ".")
    assert bad.returncode == 1 and bad.stderr.startswith("fucina: error: no chapter")


def test_solution_prints_the_book_version():
    shown = fucina("course", "solution", "2")
    assert shown.returncode == 0
    assert (REFERENCE / "tokenizer.py").read_text() in shown.stdout


def test_ask_runs_the_readers_generator_and_answers(tmp_path):
    """The acceptance question, on the reader's own stack (the book's code copied in)."""
    reader = copy_of_reference(tmp_path)
    answer = fucina("course", "ask", "What is the capital of France?", "--dir", str(reader),
                    "--max-tokens", "16")
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout
    assert "the book's version" not in answer.stderr          # all of it is the reader's


def test_ask_reports_the_readers_exception_in_one_line(tmp_path):
    reader = copy_of_reference(tmp_path)
    path = reader / "build_it.py"
    path.write_text(path.read_text().replace(
        "            cache.advance(len(ids))", "            cache.advance(undefined_name)"))
    answer = fucina("course", "ask", "Hi", "--dir", str(reader), "--max-tokens", "2")
    assert answer.returncode == 1
    assert "Traceback" not in answer.stderr
    assert "your code raised NameError" in answer.stderr and "(build_it.py:" in answer.stderr


def test_an_interrupted_check_ends_with_one_line(tmp_path):
    """Ctrl-C half-way through the checks: status 130 and `fucina: interrupted`, no
    traceback (the mixed `course` package and the alarm are put back on the way out)."""
    import signal

    reader = copy_of_reference(tmp_path)
    run = subprocess.Popen([sys.executable, "-m", "fucina_course", "course", "check",
                            "--dir", str(reader)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().startswith("chapter 01")   # it is under way
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert "fucina: interrupted" in err and "Traceback" not in err
