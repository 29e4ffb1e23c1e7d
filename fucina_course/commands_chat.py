"""`fucina chat` and `fucina repl`: one question, or a conversation in the terminal,
answered by `chat.Conversation` as the chat, sampling and speculation flags say.  The
steps the commands share (loading the model, the flags checked first) are in
commands.py."""

from __future__ import annotations

import sys

from .commands import (check_expert_top_p, check_speculation_flags, first_start,
                       load_model_for, speculator_for)
from .errors import FucinaError


def _sampling_changes(args) -> dict:
    """The sampling flags given (cli.py's sampling group: each flag's dest is the
    SamplerConfig field it sets)."""
    from dataclasses import fields

    from .sampler import SamplerConfig

    return {f.name: getattr(args, f.name) for f in fields(SamplerConfig)
            if getattr(args, f.name, None) is not None}


def _check_chat_args(args) -> None:
    """Every mistake a flag can hold, found before a model is loaded."""
    from .sampler import SamplerConfig

    SamplerConfig.qwen3().with_(**_sampling_changes(args))   # raises on a bad value
    check_expert_top_p(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise FucinaError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx < 2:
        raise FucinaError(f"--ctx must be at least 2, got {args.ctx}")
    check_speculation_flags(args)


def _conversation(args):
    """Load the model and open a conversation as the flags say."""
    from .chat import ChatFormat, Conversation
    from .sampler import SamplerConfig

    model = load_model_for(args)
    if model.tokenizer is None:
        raise FucinaError(f"{model.path}: no tokenizer in the file: it cannot chat")
    thinking = ChatFormat(model.tokenizer).can_think and not args.no_think
    config = SamplerConfig.qwen3(thinking=thinking).with_(**_sampling_changes(args))
    ctx = args.ctx or min(model.config.context_length, 4096)
    if ctx > model.config.context_length:
        raise FucinaError(f"--ctx {ctx} exceeds the model's context of "
                          f"{model.config.context_length} positions")
    first_start(model)
    return Conversation(model, system=args.system, sampler=config, capacity=ctx,
                        cache_type=args.cache_type, max_response_tokens=args.max_tokens,
                        no_think=args.no_think, show_think=args.show_think,
                        stop=args.stop or (),
                        speculator=speculator_for(args, model, ctx))


def cmd_chat(args) -> int:
    words = args.words
    if len(words) > 2:
        raise FucinaError("give the question as one quoted argument: "
                          "fucina chat [MODEL] \"QUESTION\"")
    args.model, question = (None, words[0]) if len(words) == 1 else words
    if question == "-":
        question = sys.stdin.read()
    if not question.strip():
        raise FucinaError("the question is empty")
    _check_chat_args(args)
    conv = _conversation(args)
    try:
        reply = conv.send(question, stream=sys.stdout)
    except KeyboardInterrupt:
        print(flush=True)
        raise
    print(flush=True)
    if args.stats:
        print(reply.stats() + f" [seed {conv.sampler.seed}]", file=sys.stderr)
    return 0


REPL_HELP = """\
Type a message and press Enter.  Commands:
  /reset          forget the conversation (keeps the system prompt)
  /system [TEXT]  set (or clear) the system prompt, and start over
  /exit           leave (so does Ctrl-D); Ctrl-C stops an answer"""


def cmd_repl(args) -> int:
    _check_chat_args(args)
    print(f"fucina: loading {args.model or 'the default model'} ...", file=sys.stderr)
    conv = _conversation(args)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - Windows
        pass
    print(f"{conv.model.path.name}: context {conv.cache.capacity} tokens, "
          f"seed {conv.sampler.seed}.  /help for commands, Ctrl-D to leave.",
          file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh prompt, as in Python
            print()
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, rest = line.partition(" ")
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                conv.reset()
                print("(conversation cleared)")
            elif command == "/system":
                conv.reset(system=rest.strip() or None)
                print("(system prompt " + ("set" if rest.strip() else "cleared")
                      + "; conversation cleared)")
            elif command == "/help":
                print(REPL_HELP)
            else:
                print(f"unknown command {command!r}; /help lists them")
            continue
        try:
            reply = conv.send(line, stream=sys.stdout)
        except KeyboardInterrupt:
            print("\n(interrupted)", flush=True)
            continue
        except FucinaError as e:  # the conversation is still usable
            print(f"fucina: error: {e}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        print(reply.stats(), file=sys.stderr, flush=True)
