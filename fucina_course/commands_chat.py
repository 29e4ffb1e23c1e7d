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
    args.tool_list = _tools(args)


def _tools(args) -> list | None:
    """--tools FILE.json: OpenAI's `tools` list, read and checked (a bad file is one
    line, before the model loads)."""
    if args.tools is None:
        if args.tool_choice != "auto":
            raise FucinaError("--tool-choice needs --tools")
        return None
    import json

    from .tool_calls import choice_of, tools_of

    try:
        text = open(args.tools, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise FucinaError(f"--tools {args.tools}: cannot read it: {e}") from None
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError) as e:     # RecursionError: deep nesting
        raise FucinaError(f"--tools {args.tools}: not JSON: {e}") from None
    if isinstance(tools, dict) and "tools" in tools:   # a request body's field
        tools = tools["tools"]
    checked = tools_of(tools, f"--tools {args.tools}")
    choice = args.tool_choice
    if choice not in ("auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    choice_of(choice, checked, "--tool-choice")
    args.tool_choice = choice
    return tools


def _show_calls(reply) -> list:
    """Print the answer's tool calls (stderr), and return them."""
    calls = reply.tool_calls
    for call in calls:
        print(f"[tool call] {call.name}({call.arguments})", file=sys.stderr, flush=True)
    return calls


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
                        speculator=speculator_for(args, model, ctx),
                        tools=args.tool_list, tool_choice=args.tool_choice)


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
    _show_calls(reply)
    if args.stats:
        print(reply.stats() + f" [seed {conv.sampler.seed}]", file=sys.stderr)
    return 0


REPL_HELP = """\
Type a message and press Enter.  Commands:
  /reset          forget the conversation (keeps the system prompt)
  /system [TEXT]  set (or clear) the system prompt, and start over
  /exit           leave (so does Ctrl-D); Ctrl-C stops an answer
With --tools, the model's calls are printed and you type each result."""


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
        _answer(conv, lambda: conv.send(line, stream=sys.stdout))


def _answer(conv, send) -> None:
    """One answer in the REPL; while it calls tools, the user types each result
    and the model goes on from them."""
    while True:
        try:
            reply = send()
        except KeyboardInterrupt:
            print("\n(interrupted)", flush=True)
            return
        except FucinaError as e:  # the conversation is still usable
            print(f"fucina: error: {e}", file=sys.stderr, flush=True)
            return
        print(flush=True)
        print(reply.stats(), file=sys.stderr, flush=True)
        calls = _show_calls(reply)
        if not calls:
            return
        try:
            results = [input(f"result of {c.name}> ") for c in calls]
        except (EOFError, KeyboardInterrupt):
            print("\n(no result: the calls stay unanswered)")
            return

        def send(results=results):
            return conv.send_tool_results(results, stream=sys.stdout)
