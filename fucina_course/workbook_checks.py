"""`fucina course check`: each saved definition of a reader's workbook run against its check.

The checks themselves, one per definition the chapters save, are in workbook_cases.py (what
each asserts, against which reference). This module runs them: `Fixtures` makes the shared
inputs once (the tiny synthetic models, the default model's vocabulary), `run` goes through
the chosen chapters, and `run_one` runs one check on the reader's definition (the book's for
the rest), under a time limit, turning whatever the reader's code raises into one line
pointing at the reader's file. tests/test_workbook.py runs every check on the book's code
(they must pass) and on deliberately broken versions (they must fail).
"""

from __future__ import annotations

import signal
import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from collections.abc import Callable

import numpy as np

from . import workbook
from .workbook_cases import CHECKS


class Fixtures:
    """The shared inputs, made on first use and kept for the run."""

    @cached_property
    def vocab_gguf(self):
        from .catalog import resolve
        from .gguf_file import GGUFFile
        return GGUFFile(resolve("qwen2.5-coder-0.5b"))   # metadata only: no weights read

    @cached_property
    def tokenizer(self):
        from .tokenizer import Tokenizer
        return Tokenizer.from_gguf(self.vocab_gguf)

    def synthetic(self, spec, fmt: str):
        from .gguf_file import GGUFFile
        from .synth import cached_synthetic, with_format
        return GGUFFile(cached_synthetic(with_format(spec, fmt)))

    @cached_property
    def tiny_gguf(self):                     # a tiny Qwen3 in float32: no 8-bit activations
        from .synth import TINY_QWEN3
        return self.synthetic(TINY_QWEN3, "F32")

    @cached_property
    def tiny_engine(self):
        from .model import Model
        model = Model.load(self.tiny_gguf.path)
        model.forward_last_logits([1, 2])        # compiles its kernels now, not in a check
        return model

    @cached_property
    def tiny_weights(self) -> dict[str, np.ndarray]:
        from gguf.quants import dequantize
        return {name: dequantize(np.asarray(t.data).reshape(-1), t.ggml_type)
                .reshape(t.shape[::-1]) for name, t in self.tiny_gguf.tensors.items()}

    @cached_property
    def tiny_moe_engine(self):
        from .model import Model
        from .synth import TINY_QWEN3_MOE
        model = Model.load(self.synthetic(TINY_QWEN3_MOE, "F32").path)
        model.forward_last_logits([1, 2])
        return model

    # What each module's checks use: made before a check's clock starts (the first run
    # writes the synthetic models and compiles the engine's kernels).
    NEEDS = {"tokenizer": ["tokenizer"], "forward": ["tiny_engine", "tiny_weights"],
             "kv_cache": ["tiny_engine"], "chat": ["vocab_gguf"],
             "moe": ["tiny_moe_engine"], "speculative": ["tiny_engine"],
             "build_it": ["tiny_engine", "tiny_weights", "tokenizer"]}

    def prepare(self, module: str) -> None:
        for name in self.NEEDS.get(module, ()):
            getattr(self, name)

    def greedy(self, ids, n: int, stop=()) -> list[int]:
        """The engine's greedy tokens after `ids` on the tiny model (up to a stop id)."""
        return self.tiny_engine.generate(ids, n, stop_ids=set(stop))


# --- running them ------------------------------------------------------------------------

@dataclass
class Result:
    chapter: workbook.Chapter
    name: str
    status: str            # "passed", "failed", "not implemented"
    detail: str = ""


def where_in(err: BaseException, reader: Path) -> str:
    """The last line of the reader's own files in the traceback: 'tokenizer.py:12'."""
    spots = [f"{Path(f.filename).name}:{f.lineno}"
             for f in traceback.extract_tb(err.__traceback__)
             if Path(f.filename).resolve().parent == reader.resolve()]
    return f" ({spots[-1]})" if spots else ""


class CheckTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    """SIGALRM after `seconds` (main thread, POSIX); elsewhere no limit."""
    usable = (seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"still running after {seconds:g} s (an endless loop?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_one(reader: Path, chapter: workbook.Chapter, name: str, fx: Fixtures,
            timeout: float = 60.0) -> Result:
    def keep(module: str, n: str) -> bool:          # the reader's: only the one checked
        return (module, n) == (chapter.module, name)

    fx.prepare(chapter.module)
    try:
        with workbook.environment(reader, keep) as course, _time_limit(timeout):
            CHECKS[(chapter.module, name)](course, fx)
    except CheckTimeout as err:
        return Result(chapter, name, "failed", f"{err}{where_in(err, reader)}")
    except NotImplementedError as err:
        return Result(chapter, name, "not implemented", str(err))
    except AssertionError as err:
        first = (str(err).splitlines() or ["an assert failed"])[0]
        return Result(chapter, name, "failed", first[:160] + where_in(err, reader))
    except Exception as err:  # the reader's code may raise anything: report, go on
        return Result(chapter, name, "failed",
                      f"{type(err).__name__}: {str(err)[:120]}{where_in(err, reader)}")
    return Result(chapter, name, "passed")


def run(reader: Path, chosen: list[workbook.Chapter], fx: Fixtures | None = None,
        on_result: Callable[[Result], None] | None = None,
        timeout: float = 60.0) -> list[Result]:
    """Every saved definition of the chosen chapters: checked, or reported unwritten."""
    fx = fx or Fixtures()
    results = []
    for chapter in chosen:
        state, broken = workbook.reader_state(reader, chapter)
        for name, written in state.items():
            if (chapter.module, name) not in CHECKS:
                raise workbook.WorkbookError(f"no check for {chapter.module}.{name}")
            if broken:
                result = Result(chapter, name, "failed", broken)
            elif not written:
                result = Result(chapter, name, "not implemented")
            else:
                result = run_one(reader, chapter, name, fx, timeout)
            results.append(result)
            if on_result:
                on_result(result)
    return results
