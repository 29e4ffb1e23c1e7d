"""What the `fucina` subcommands share: the model they run, found and loaded as the
flags say, and the flags checked before it loads.

cli.py parses the command line (from its tables) and calls one `cmd_*` function; each
lives in the module of its concern:

    commands_info.py    info, tokenize, models: a model file or the catalog, nothing run
    commands_run.py     generate, logits, verify-cache, bench
    commands_chat.py    chat, repl
    commands_serve.py   serve
    commands_course.py  course: the reader's workbook

A mistake the user can make is raised as a `FucinaError`, which cli.py prints as one
line.  The work itself lives in the library: catalog.load_model loads every model a
command runs, startup.py compiles what a first run still needs (after the command's
own checks have passed, so a bad flag never waits for a compiler), chat.Conversation
chats.  Imports are made inside the functions, so that `--threads` can size the thread
pools before numpy and numba load.
"""

from __future__ import annotations

import sys

from .errors import FucinaError


def open_file(model: str):
    """The GGUF of a named model or a path (catalog.resolve), opened: metadata only."""
    from .gguf_file import GGUFFile
    from .catalog import resolve

    return GGUFFile(resolve(model))


def load_model_for(args):
    """The model of every command that runs one (catalog.load_model), with the first
    start's helper process started as it loads (first run only: startup.py)."""
    from . import startup
    from .catalog import load_model, resolve

    check_expert_top_p(args)
    budget = _expert_cache(args)
    path = resolve(args.model)
    startup.start_early(path)
    model = load_model(path, threads=args.threads, expert_top_p=args.expert_top_p)
    from .expert_cache import attach, auto_budget

    if budget is None and (budget := auto_budget(model)) is not None:
        print(f"fucina: {model.path.name} ({model.gguf.size / 2**30:.1f} GiB) does not "
              f"fit the memory this process may use: its experts are read from disk "
              f"through a {budget / 2**30:.2f} GiB cache (--expert-cache chooses)",
              file=sys.stderr)
    if budget is not None:
        model.expert_cache = attach(model, budget)
    return model


def _expert_cache(args) -> int | None:
    """--expert-cache SIZE in bytes (checked before anything loads), or None."""
    if getattr(args, "expert_cache", None) is None:
        return None
    from .expert_cache import parse_size

    return parse_size(args.expert_cache)


def check_expert_top_p(args) -> None:
    from .moe import check_top_p

    check_top_p(args.expert_top_p, "--expert-top-p")


def first_start(model) -> None:
    """Compile the kernels a first run still needs, once the command's own checks
    have passed (startup.first_start)."""
    from . import startup

    startup.first_start(model)


def prompt_ids(model, args) -> list[int]:
    if getattr(args, "ids", None):
        try:
            return [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise FucinaError(f"--ids must be comma-separated integers, "
                              f"got {args.ids!r}") from None
    if model.tokenizer is None:
        raise FucinaError(f"{model.path}: no tokenizer in the file; pass --ids")
    text = args.prompt
    if getattr(args, "chat", False):
        from .chat import render_prompt

        return model.tokenizer.encode_raw(render_prompt(model.tokenizer, text))
    return model.tokenizer.encode(text)


def cache_for(model, n_tokens: int, cache_type: str):
    """A cache for n_tokens positions; more than the model's context is an error."""
    from .errors import KvCacheOverflow

    if n_tokens > model.config.context_length:
        raise KvCacheOverflow(f"{n_tokens} tokens do not fit in the model's context of "
                              f"{model.config.context_length} positions")
    first_start(model)                  # the last check passed: compile, if needed
    return model.new_cache(n_tokens, cache_type)


# --- speculation: --speculate and --draft-max -------------------------------------

def check_spec(spec: str | None) -> None:
    """Refuse a `--speculate` value that is neither 'lookup' nor 'draft:MODEL'
    (before any model is loaded)."""
    if spec and spec != "lookup" and not (spec.startswith("draft:")
                                          and len(spec) > len("draft:")):
        raise FucinaError(f"--speculate must be 'lookup' or 'draft:MODEL', "
                          f"got {spec!r}")


def make_speculator(spec: str | None, target, *, draft_max: int | None = None,
                    threads: int | None = None, cache_type: str = "f16",
                    capacity: int | None = None):
    """`--speculate` as the CLI spells it: None/"" (off), "lookup", or
    "draft:MODEL" (a path or named model sharing the target's vocabulary).  The
    caller finds and loads the draft model; the engine's speculative module only
    receives it (it never reaches up to where files live)."""
    from .speculative import (DEFAULT_DRAFT_MAX, DraftModel, PromptLookup, Speculator,
                              check_same_vocabulary, same_tokens)

    draft_max = DEFAULT_DRAFT_MAX if draft_max is None else draft_max
    if not spec:
        return None
    check_spec(spec)
    if spec == "lookup":
        return Speculator(PromptLookup(), draft_max)
    from .catalog import load_model, resolve

    draft = load_model(resolve(spec[len("draft:"):]), threads=threads)
    check_same_vocabulary(draft, target.config.vocab_size)
    if not same_tokens(draft.tokenizer, target.tokenizer):
        raise FucinaError(f"draft model {draft.path.name} spells its ids "
                          f"differently from {target.path.name}: a draft must "
                          "share the target's tokenizer")
    return Speculator(DraftModel(draft, capacity=capacity, cache_type=cache_type),
                      draft_max)


def check_speculation_flags(args) -> None:
    """The speculation flags, checked before a model is loaded."""
    check_spec(getattr(args, "speculate", None))
    if getattr(args, "draft_max", 1) < 1:
        raise FucinaError(f"--draft-max must be at least 1, got {args.draft_max}")


def speculator_for(args, model, capacity: int):
    """`--speculate` / `--draft-max` as a Speculator (None: off); a draft model is
    loaded with the target's threads and cache type."""
    return make_speculator(getattr(args, "speculate", None), model,
                           draft_max=args.draft_max, threads=args.threads,
                           cache_type=args.cache_type, capacity=capacity)
