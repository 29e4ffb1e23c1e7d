"""Compile the integer kernels with LLVM for one instruction-set level; cache the code.

The integer kernels are LLVM IR built with llvmlite (_int_matvec.py, _int_matmul.py).
This module turns one format's IR into machine code for one level (isa.py) and hands
back the addresses of its functions, which numba's parallel driver (_int.run) calls.

Why not let numba compile them, as it does the rest of the engine:

* **An exact target.**  numba compiles every kernel of a process for one CPU (the
  host).  Here each level gets its own LLVM target machine: the baseline x86-64 CPU
  plus exactly the level's features (`isa.target`).  The avx2 kernels are thus
  compiled for a CPU without AVX-512 even on a machine that has it, and LLVM cannot
  select an instruction of a feature its target lacks: no zmm, EVEX or mask register
  can appear in them (tests/test_quant.py also reads their assembly to be sure).
* **A fast first start.**  numba spends 2-5 s per parallel kernel (type inference,
  the parfor passes) before LLVM sees it; here a format's module goes straight to
  LLVM's optimizer and code generator (~0.2-0.6 s).

The object code is cached on disk next to numba's cache of this package (the same
directory, so clearing one clears both), keyed by everything that shapes it: the hash
of every quant/*.py file (_cache.py), the level's target, the LLVM version.  A warm
start loads the object file into LLVM's JIT linker (MCJIT) without compiling anything.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time

import llvmlite
import llvmlite.binding as ll
from llvmlite import ir

from . import _cache, isa

_lock = threading.RLock()
_engine = None
_loaded: dict[tuple[str, str], dict[str, int]] = {}
compile_seconds = 0.0          # thread CPU time spent compiling, this process


def init():
    """Initialize LLVM and make the JIT engine (once; before any thread compiles)."""
    global _engine
    if _engine is None:
        ll.initialize_native_target()
        ll.initialize_native_asmprinter()
        tm = ll.Target.from_default_triple().create_target_machine(jit=True)
        _engine = ll.create_mcjit_compiler(ll.parse_assembly(""), tm)
    return _engine


def target_machine(level: str):
    """An LLVM target machine for `level`'s features only (isa.target)."""
    init()
    cpu, features, _ = isa.target(level)
    target = ll.Target.from_default_triple()
    # the relocations and code model numba's own JIT uses on this architecture (static
    # on x86, where MCJIT places each section anywhere in memory; PIC on POWER; the
    # default elsewhere: the generic level's kernels on ARM)
    reloc = ("static" if target.name.startswith("x86") else
             "pic" if target.name.startswith("ppc") else "default")
    return target.create_target_machine(cpu=cpu, features=features, opt=3,
                                        reloc=reloc, codemodel="jitdefault", jit=True)


def cache_dir() -> str:
    """Where numba caches this package's kernels (NUMBA_CACHE_DIR, quant/__pycache__
    or a user-wide directory, in numba's order); the object files go there too."""
    for loc_cls in _cache._LOCATORS:
        loc = loc_cls.from_function(cache_dir, __file__)
        if loc is not None:
            try:
                loc.ensure_cache_path()
            except OSError:
                continue
            return loc.get_cache_path()
    return tempfile.gettempdir()


def _key(name: str, level: str) -> str:
    h = hashlib.sha256()
    for part in (_cache.package_stamp(), name, level, *isa.target(level),
                 ".".join(map(str, ll.llvm_version_info)), llvmlite.__version__):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def object_path(name: str, level: str) -> str:
    return os.path.join(cache_dir(), f"_jit.{name}.{level}.{_key(name, level)}.o")


def new_module(name: str) -> ir.Module:
    mod = ir.Module(name)
    mod.triple = ll.get_process_triple()
    return mod


def _optimized(mod: ir.Module, level: str):
    """(target machine, `mod` parsed and optimized with LLVM -O3 for `level`).  Every
    function is tuned for this CPU's scheduling ("tune-cpu", isa.target), a string
    attribute llvmlite's IR builder has no API for, hence the text edit."""
    tm = target_machine(level)
    tune = isa.target(level)[2]
    text = str(mod).replace(") nounwind\n{", f') nounwind "tune-cpu"="{tune}"\n{{')
    return tm, _optimize(text, tm)


def _optimize(text: str, tm):
    """LLVM IR `text` parsed and optimized with -O3 for the target machine `tm`.  In a
    context of its own: numba may be compiling in another thread (startup.py)."""
    llmod = ll.parse_assembly(text, context=ll.create_context())
    llmod.triple = tm.triple
    llmod.data_layout = str(tm.target_data)
    llmod.verify()
    pto = ll.create_pipeline_tuning_options(speed_level=3)
    pb = ll.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(llmod, pb)
    return llmod


def assembly_for(mod: ir.Module, triple: str, cpu: str, features: str = "",
                 tune: str | None = None) -> str:
    """The assembly of `mod` optimized and compiled for another target: a CPU model of
    any architecture LLVM knows (tests/test_quant.py's portability checks,
    bench/mca_prefill.py's ARM models).  `mod`'s triple should be `triple`: the IR
    helpers choose x86 intrinsics by it (_ir.madd_host).  `tune`: a CPU whose
    scheduling every function gets, as `_optimized` does for this machine's."""
    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()
    tm = ll.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features,
                                                             opt=3)
    text = str(mod)
    if tune is not None:
        text = text.replace(") nounwind\n{", f') nounwind "tune-cpu"="{tune}"\n{{')
    return tm.emit_assembly(_optimize(text, tm))


def compile_module(mod: ir.Module, level: str) -> bytes:
    """`mod` optimized and compiled for `level`: ELF object code."""
    tm, llmod = _optimized(mod, level)
    return tm.emit_object(llmod)


def assembly(mod: ir.Module, level: str) -> str:
    """The x86 assembly of `mod` compiled for `level` (what tests inspect)."""
    tm, llmod = _optimized(mod, level)
    return tm.emit_assembly(llmod)


def is_cached(name: str, level: str) -> bool:
    return (name, level) in _loaded or os.path.exists(object_path(name, level))


def _store(path: str, obj: bytes) -> None:
    d, base = os.path.split(path)
    stem = base.split(".")[:3]                  # _jit, name, level
    try:
        for old in os.listdir(d):               # the same kernels, other sources
            if old.split(".")[:3] == stem and old != base and old.endswith(".o"):
                os.unlink(os.path.join(d, old))
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(obj)
        os.replace(tmp, path)
    except OSError:
        pass                                    # a read-only cache: compile next time


def load(name: str, level: str, build, symbols) -> dict[str, int]:
    """{symbol: address} of the functions `build(module)` defines, compiled for `level`:
    from the disk cache, else compiled now (and cached)."""
    key = (name, level)
    with _lock:
        got = _loaded.get(key)
        if got is not None:
            return got
        engine = init()
        path = object_path(name, level)
        try:
            with open(path, "rb") as f:
                obj = f.read()
        except OSError:
            global compile_seconds
            t0 = time.thread_time()
            mod = new_module(f"{name}.{level}")
            build(mod)
            obj = compile_module(mod, level)
            compile_seconds += time.thread_time() - t0
            _store(path, obj)
        engine.add_object_file(ll.ObjectFileRef.from_data(obj))
        engine.finalize_object()
        got = {s: engine.get_function_address(s) for s in symbols}
        if not all(got.values()):
            raise RuntimeError(f"{name} ({level}): missing symbols in the object code")
        _loaded[key] = got
        return got


def clear_cache() -> list[str]:
    """Delete every cached object file of this package (numba's own files stay)."""
    d = cache_dir()
    gone = []
    for n in os.listdir(d):
        if n.startswith("_jit.") and n.endswith(".o"):
            os.unlink(os.path.join(d, n))
            gone.append(n)
    return gone
