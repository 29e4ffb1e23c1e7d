"""`fucina course`: the reader's workbook (workbook.py) written, checked
(workbook_checks.py), shown the book's version of, and asked a question through the
reader's own generator."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import FucinaError


def cmd_course(args) -> int:
    return {"init": _course_init, "check": _course_check, "ask": _course_ask,
            "solution": _course_solution}[args.action](args)


def _course_init(args) -> int:
    from . import workbook

    written = workbook.init(Path(args.dir))
    print(f"wrote {len(written)} files into {args.dir}/ (one module per chapter that writes "
          f"course code; read {args.dir}/README.md)")
    print(f"next: fill the stubs, then `fucina course check --dir {args.dir}`")
    return 0


def _workbook_dir(args) -> Path:
    reader = Path(args.dir)
    if not reader.is_dir():
        raise FucinaError(f"no workbook at {reader}/ (create one with `fucina course init "
                          f"{reader}`, or pass --dir)")
    return reader


def _course_check(args) -> int:
    from . import workbook, workbook_checks

    reader = _workbook_dir(args)
    chosen = workbook.select(args.chapters)
    marks = {"passed": "ok  ", "failed": "FAIL", "not implemented": "todo"}
    current = [None]

    def show(r):
        if r.chapter != current[0]:
            current[0] = r.chapter
            print(r.chapter.label)
        detail = f": {r.detail}" if r.status == "failed" else ""
        todo = " (not implemented)" if r.status == "not implemented" else ""
        print(f"  {marks[r.status]} {r.name}{todo}{detail}", flush=True)

    if not args.timeout > 0:
        raise FucinaError("--timeout must be a positive number of seconds")
    results = workbook_checks.run(reader, chosen, on_result=show, timeout=args.timeout)
    counts = {s: sum(r.status == s for r in results) for s in marks}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing to check")
    return 0 if counts["passed"] == len(results) else 1


def _course_solution(args) -> int:
    from . import workbook

    (chapter,) = workbook.select([args.chapter])
    path = workbook.REFERENCE / f"{chapter.module}.py"
    print(f"# {chapter.label}: the book's version ({path})\n")
    print(path.read_text(), end="")
    return 0


# `fucina course ask` runs the reader's numpy model: its attention holds [heads, n, n]
# float32 scores per layer and its cache is allocated for prompt + answer up front, so both
# are bounded before anything runs: 2,000 characters of one-character tokens ("7 7 7 ...")
# took 23 s and 3.8 GB at the peak here (Zen 4, 2 cores); 4,000 took 85 s and 5.3 GB.
ASK_MAX_CHARS = 2_000
ASK_MAX_TOKENS = 4_096


def _check_question(args) -> None:
    import math

    if len(args.question) > ASK_MAX_CHARS:
        raise FucinaError(f"the question has {len(args.question):,} characters; `fucina "
                          f"course ask` takes at most {ASK_MAX_CHARS:,} (your numpy model "
                          "attends over the whole prompt at once)")
    try:
        args.question.encode("utf-8")
    except UnicodeEncodeError as err:
        raise FucinaError("the question is not valid UTF-8 text") from err
    if not 1 <= args.max_tokens <= ASK_MAX_TOKENS:
        raise FucinaError(f"--max-tokens must be 1 .. {ASK_MAX_TOKENS:,}")
    if not (math.isfinite(args.temp) and args.temp >= 0):
        raise FucinaError("--temp must be a finite number >= 0")
    if not 0 <= args.seed < 2**63:
        raise FucinaError("--seed must be 0 .. 2^63-1")


def _course_ask(args) -> int:
    """The reader's generator, end to end: their tokenizer, model, cache, sampler and
    template where written, the book's where not (said on stderr first)."""
    from . import catalog, workbook
    from .gguf_file import GGUFFile

    reader = _workbook_dir(args)
    _check_question(args)
    written = workbook.written_by_reader(reader)
    book = [f"{module}.{n}" for module, names in written.items()
            for n, done in names.items() if not done]
    if book:
        which = (", ".join(book) if len(book) <= 6
                 else f"`fucina course check --dir {reader}` lists them")
        print(f"fucina: the book's version of {len(book)} definitions you have not written "
              f"({which})", file=sys.stderr)
    gguf = GGUFFile(catalog.resolve(args.model))
    def keep(module: str, name: str) -> bool:      # theirs wherever they wrote it
        return written.get(module, {}).get(name, False)

    with workbook.environment(reader, keep) as course:
        m = course("build_it")
        try:
            tok = m.CourseTokenizer(gguf)
            print("fucina: decoding the weights to float32 ...", file=sys.stderr, flush=True)
            model = m.CourseModel.load(gguf)
            shown, out = [""], []

            def stream(token):
                out.append(token)
                text = tok.decode([t for t in out if t not in tok.stop])
                if not text.endswith("\ufffd"):        # wait for a character's last byte
                    print(text[len(shown[0]):], end="", flush=True)
                    shown[0] = text

            m.ask(model, tok, args.question, max_tokens=args.max_tokens,
                  temperature=args.temp, seed=args.seed, on_token=stream)
        except FucinaError:
            raise
        except NotImplementedError as err:   # a class with some methods still stubs
            raise FucinaError(f"not implemented yet: {err}") from err
        except Exception as err:  # the reader's code: one line, where it failed
            from .workbook_checks import where_in
            raise FucinaError(f"your code raised {type(err).__name__}: {err}"
                              f"{where_in(err, reader)}") from err
    print()
    return 0
