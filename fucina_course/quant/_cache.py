"""numba's disk cache for the quant kernels, stamped with every file of this package.

numba re-uses a cached kernel while the file that defines it is unchanged (it hashes
that file); it does not look at the files whose code the kernel inlines.  The quant
kernels do inline code from other files: LLVM IR built in _ir.py, _int_matvec.py and
_intrinsics.py, and numba helpers such as `_chunks`.  (_jit.py keys its object files
with the same stamp.)  So the rule here is:

    a cached kernel in quant/ is fresh only while *every* quant/*.py file is unchanged.

Editing any of them recompiles the quant kernels on next use (a few seconds per format
for a developer; a reader who does not edit the package never pays it).  This module
installs that rule by putting one cache locator in front of numba's own: for functions
defined in this directory it is numba's locator (same cache files, same places) with the
package hash as the source stamp; everything else is left to numba.  It must be imported
before the first `@njit(cache=True)` of the package runs, which quant/__init__.py does.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache

from numba.core import caching

_DIR = os.path.dirname(os.path.abspath(__file__))


@lru_cache(maxsize=8)
def _hash(stats: tuple) -> str:
    h = hashlib.sha256()
    for name, _, _ in stats:
        with open(os.path.join(_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def package_stamp() -> str:
    """sha256 of all quant/*.py files (re-read only when a size or mtime changes)."""
    names = sorted(n for n in os.listdir(_DIR) if n.endswith(".py"))
    stats = []
    for n in names:
        st = os.stat(os.path.join(_DIR, n))
        stats.append((n, st.st_mtime_ns, st.st_size))
    return _hash(tuple(stats))


class _PackageStamp:
    """Mixin for a numba locator: files of quant/ only, stamped with package_stamp."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != _DIR:
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return package_stamp()


def _numba(name: str):
    # numba 0.68 made these names public; older versions spell them with a "_"
    return getattr(caching, name, None) or getattr(caching, "_" + name)


_LOCATORS = [type("Quant" + base.__name__.lstrip("_"), (_PackageStamp, base), {})
             for base in (_numba("UserProvidedCacheLocator"),
                          _numba("InTreeCacheLocator"),
                          _numba("UserWideCacheLocator"))]


def install() -> None:
    """Put the package-stamped locators first in numba's list (idempotent)."""
    classes = _numba("CacheImpl")._locator_classes
    if not any(issubclass(c, _PackageStamp) for c in classes):
        classes[:0] = _LOCATORS


install()
