"""Which instruction-set level the kernels may use on this CPU.

A *level* names a family of kernels.  "float" is the portable one: plain numba loops
(matvec.py) that LLVM vectorizes for whatever CPU it compiles for, so it runs
everywhere.
"avx512vnni" is the integer kernels of _vnni_matvec.py / _vnni_matmul.py, which emit
AVX-512 VNNI instructions themselves and therefore must never be called on a CPU without
them (an illegal instruction kills the process).  The dispatch tables of matvec.py and
matmul.py are keyed by (format, level); a new level is a name and its feature set here,
plus kernels and table entries there.

The decision is made once, at import, from the feature string numba compiles for (the
host's, or NUMBA_CPU_FEATURES).  FUCINA_NO_VNNI=1 forces the float kernels.
"""

from __future__ import annotations

import os

from numba.core import config
from numba.core.codegen import get_host_cpu_features

FLOAT = "float"
AVX512VNNI = "avx512vnni"

# level -> the LLVM features its kernels emit.  AVX512VNNI: vpdpbusd/vpdpwssd on ymm and
# zmm (VNNI + VL), byte/word ops and mask registers (BW).  (AVX-VNNI alone, e.g. Alder
# Lake, has the ymm vpdpbusd but not the masked byte ops and zmm forms.)
NEEDED_FEATURES: dict[str, frozenset[str]] = {
    AVX512VNNI: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512vnni"}),
    FLOAT: frozenset(),
}


def numba_cpu_features() -> str:
    """The LLVM feature string numba compiles for: NUMBA_CPU_FEATURES or the host's."""
    if config.CPU_FEATURES is not None:
        return str(config.CPU_FEATURES)
    return str(get_host_cpu_features())


def usable(level: str, features: str) -> bool:
    """True if an LLVM feature string ("+avx2,-avx512f,...") has all `level` uses."""
    on = {f[1:] for f in features.split(",") if f.startswith("+")}
    return NEEDED_FEATURES[level] <= on


def vnni_usable(features: str) -> bool:
    return usable(AVX512VNNI, features)


def _forced_off() -> bool:
    return os.environ.get("FUCINA_NO_VNNI", "") not in ("", "0")


# The levels this process may run, best first.
USABLE: tuple[str, ...] = tuple(
    lv for lv in (AVX512VNNI,)
    if usable(lv, numba_cpu_features()) and not _forced_off()) + (FLOAT,)
BEST = USABLE[0]
HAVE_VNNI = AVX512VNNI in USABLE

# The level the dispatchers (matvec, matmul) use.  Assign isa.FLOAT to run the portable
# kernels (tests, benchmarks); a level missing from USABLE also gets them, since the
# dispatch tables only hold the kernels of usable levels.
level = BEST
