"""What each `fucina` subcommand does, given its parsed arguments.

cli.py parses the command line (from its tables) and calls one `cmd_*` function here;
a mistake the user can make is raised as a `FucinaError`, which cli.py prints as one
line.  The work itself lives in the library: catalog.load_model loads every model a
command runs, startup.py compiles what a first run still needs (after the command's
own checks have passed, so a bad flag never waits for a compiler), chat.Conversation
chats.  Imports are made inside the commands, so that `--threads` can size the thread
pools before numpy and numba load.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .errors import FucinaError


def _open(model: str):
    from .gguf_file import GGUFFile
    from .catalog import resolve

    return GGUFFile(resolve(model))


# --- info -------------------------------------------------------------------------

def _kernel_lines(types=None) -> list[str]:
    """`info --kernels`: the instruction-set level and each format's kernels."""
    from .quant import isa, kernel_choices

    rows = kernel_choices(types)
    w = max([len("matvec (decode)")] + [len(mv) for _, _, mv, _ in rows])
    out = [f"kernels: level {isa.level} on {isa.cpu_family()} (this CPU runs "
           f"{', '.join(isa.USABLE)}; FUCINA_SIMD=<level> forces a lower one)",
           f"  {'format':<6} {'level':<10}  {'matvec (decode)':<{w}}  matmul (prefill)"]
    for name, level, mv, mm in rows:
        out.append(f"  {name:<6} {level:<10}  {mv:<{w}}  {mm}")
    return out


def cmd_info(args) -> int:
    from .catalog import open_tokenizer
    from .config import Config

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
        tok = open_tokenizer(g)
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
        tied = "yes" if cfg.family.tensor("lm_head").name not in g.tensors else "no"
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
    stacked = {t.name for t in cfg.family.layer if len(t.dims) == 3}   # the experts
    stacks = [t for t in g.tensors.values() if t.name.split(".", 2)[-1] in stacked]
    idle = sum(t.n_elements for t in stacks) * (1 - cfg.num_experts_used
                                                / cfg.num_experts)
    active = params - idle
    return (f"  experts: {cfg.num_experts} per layer, {cfg.num_experts_used} per "
            f"token: {active / 1e6:,.1f} M parameters active per token "
            f"({active / params:.0%})")


# --- tokenize ---------------------------------------------------------------------

def cmd_tokenize(args) -> int:
    from .catalog import open_tokenizer

    tok = open_tokenizer(_open(args.model))
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
    """The model of every command that runs one (catalog.load_model), with the first
    start's helper process started as it loads (first run only: startup.py)."""
    from . import startup
    from .catalog import load_model, resolve

    _check_expert_top_p(args)
    path = resolve(args.model)
    startup.start_early(path)
    return load_model(path, threads=args.threads, expert_top_p=args.expert_top_p)


def _check_expert_top_p(args) -> None:
    from .moe import check_top_p

    check_top_p(args.expert_top_p, "--expert-top-p")


def _first_start(model) -> None:
    """Compile the kernels a first run still needs, once the command's own checks
    have passed (startup.first_start)."""
    from . import startup

    startup.first_start(model)


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
    _check_draft_max(args)
    cache = _cache_for(model, n, args.cache_type)
    from .kv_cache import prompt_fits

    if not prompt_fits(len(ids), cache.capacity):
        raise FucinaError(f"the prompt ({len(ids)} tokens) leaves no room to generate "
                          f"in the model's context of {model.config.context_length} "
                          "positions")
    spec = _speculator(args, model, n)
    stop_ids = None if not args.ignore_eos else set()
    start = time.perf_counter()
    if spec is None:
        out = model.generate(ids, args.gen, cache=cache, on_token=show,
                             stop_ids=stop_ids)
    else:
        from .speculative import generate

        out = generate(model, ids, args.gen, spec, cache=cache, on_token=show,
                       stop_ids=stop_ids)
    seconds = time.perf_counter() - start
    if stream is not None:
        sys.stdout.write(stream.flush() + "\n")
    if args.stats:
        line = (f"[{len(out)} tokens in {seconds:.2f} s with the prefill of "
                f"{len(ids)}: {len(out) / seconds:.1f} tok/s]")
        print(line + (f" [{spec.stats.line()}]" if spec else ""), file=sys.stderr)
    if args.ids_out:
        Path(args.ids_out).write_text("".join(f"{i}\n" for i in out))
    return 0


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


def _check_draft_max(args) -> None:
    """The speculation flags, checked before a model is loaded."""
    check_spec(getattr(args, "speculate", None))
    if getattr(args, "draft_max", 1) < 1:
        raise FucinaError(f"--draft-max must be at least 1, got {args.draft_max}")


def _speculator(args, model, capacity: int):
    """`--speculate` / `--draft-max` as a Speculator (None: off); a draft model is
    loaded with the target's threads and cache type."""
    return make_speculator(getattr(args, "speculate", None), model,
                           draft_max=args.draft_max, threads=args.threads,
                           cache_type=args.cache_type, capacity=capacity)


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
        return (f"worst {float(diff.max()):.3g}, "
                f"argmax equal at {int(same.sum())}/{len(same)}")

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
    _check_expert_top_p(args)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise FucinaError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx < 2:
        raise FucinaError(f"--ctx must be at least 2, got {args.ctx}")
    _check_draft_max(args)


def _conversation(args):
    """Load the model and open a conversation as the flags say."""
    from .chat import ChatFormat, Conversation
    from .sampler import SamplerConfig

    model = _load_model(args)
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
                        stop=args.stop or (), speculator=_speculator(args, model, ctx))


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


# --- serve ---------------------------------------------------------------------------

def cmd_serve(args) -> int:
    """`fucina serve`: check the flags, load the model, bind the port, serve until
    Ctrl-C or SIGTERM (which cancel the running requests: exit code 0).  If the
    engine fails (a bug), `Server.run` raises a `FucinaError`: one line, exit 1."""
    try:                   # the `serve` extra: pip install 'fucina_course[serve]'
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise FucinaError(f"fucina serve needs the serve extra ({err.name} is missing): "
                          "pip install -e '.[serve]' (or -r requirements.txt)") from err
    from .server import Server, is_loopback, normalize_origin

    if args.parallel < 1:
        raise FucinaError(f"--parallel must be at least 1, got {args.parallel}")
    if args.queue is not None and args.queue < 0:
        raise FucinaError(f"--queue must be at least 0, got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise FucinaError(f"--port must be in 0 .. 65535, got {args.port}")
    if args.ctx is not None and args.ctx < 2:
        raise FucinaError(f"--ctx must be at least 2, got {args.ctx}")
    api_key = args.api_key or os.environ.get("FUCINA_API_KEY") or None
    origins = _names(args.cors_origins)
    for origin in origins:                          # before the model is loaded
        normalize_origin(origin)
    _check_expert_top_p(args)
    _check_draft_max(args)
    model = _load_model(args)
    if model.tokenizer is None:
        raise FucinaError(f"{model.path}: no tokenizer in the file: it cannot serve")
    if args.ctx is not None and args.ctx > model.config.context_length:
        raise FucinaError(f"--ctx {args.ctx} exceeds the model's context of "
                          f"{model.config.context_length} positions")
    from .catalog import DEFAULT_MODEL, NAMED_MODELS

    name = args.model or os.environ.get("FUCINA_MODEL") or DEFAULT_MODEL
    model_id = name if name in NAMED_MODELS else model.path.stem   # what clients send
    server = Server(model, model_id=model_id, host=args.host, port=args.port,
                    parallel=args.parallel, ctx=args.ctx, cache_type=args.cache_type,
                    queue_size=args.queue, api_key=api_key,
                    speculator=_speculator(args, model, args.ctx or min(
                        model.config.context_length, 4096)),
                    cors_origins=origins,
                    allow_hosts=_names(args.allow_hosts))
    _first_start(model)
    if not is_loopback(args.host) and api_key is None:
        print(f"fucina: warning: listening on {args.host} without --api-key: anyone "
              "who can reach this port can use the model", file=sys.stderr)
    if "*" in origins and api_key is None:
        print("fucina: warning: --cors-origins '*' without --api-key: any web page "
              "you visit can use the model", file=sys.stderr)
    sched = server.scheduler
    print(f"fucina: serving {model_id} at {server.url}/v1 ({sched.parallel} slots of "
          f"{sched.capacity} positions, queue {sched.queue_size}"
          f"{', API key required' if api_key else ''}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    server.run()
    print("fucina: server stopped", file=sys.stderr, flush=True)
    return 0


def _names(value: str) -> list[str]:
    """A comma-separated flag -> its non-empty items."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


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


# --- fucina course: the reader's workbook (workbook.py, workbook_checks.py) ---------------

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
