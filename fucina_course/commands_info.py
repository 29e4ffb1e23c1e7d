"""`fucina info`, `fucina tokenize` and `fucina models`: a model file, or the catalog
of named models, looked at; nothing is run (no weights are read).  The steps the
commands share are in commands.py."""

from __future__ import annotations

import sys
from pathlib import Path

from .commands import open_file
from .errors import FucinaError


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
    g = open_file(args.model)
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

    tok = open_tokenizer(open_file(args.model))
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
