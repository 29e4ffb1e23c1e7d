"""Experts streamed from disk: a mixture-of-experts model bigger than the memory.

A MoE token reads the router and k experts of each layer, a small part of the file
(Qwen3-30B-A3B: 8 of 128 experts).  Memory-mapped, every expert is a range of pages the
kernel faults in 4 KiB at a time, with no idea which expert comes next, and evicts as
it likes when the file does not fit: the decode step waits on one fault after another
(the issue measured it: most of a run's time in the kernel).  Here the experts are
read instead, with large positioned reads (`os.preadv`, which releases the GIL, on a
few threads), into a fixed pool of slots, one expert's three matrices each:

* **A byte budget.**  `ExpertCache(budget)` holds as many experts as fit; the dense
  weights (attention, norms, routers, embeddings) stay mapped, as before.
* **LRU, and pinning.**  A slot to refill is the least recently used one, but the most
  used experts (counted while running) are pinned in a fraction of the slots
  (`pin_fraction`) and never evicted: real routers have favourites.
* **Lookahead.**  When layer L has routed, its missing experts are read at once, and
  layer L + 1's router applied to layer L's input predicts which experts it will
  want; those are read in the background while layer L computes (`prefetch`).  A
  prediction that was wrong costs a read that was not needed, never a wrong result:
  the layer only ever runs on the experts it routed to.
* **The same numbers.**  The kernels run on the slots' bytes, which are the file's
  bytes: the logits are bit-identical to the fully mapped run (tests/test_expert_cache.py).

Reads bypass the mapping, so after each one the page cache is told to drop the range
(`posix_fadvise(DONTNEED)`): the pages would otherwise count against the memory the
process may use (a cgroup limit counts the page cache) and push out the mapped dense
weights.  A read that fails (a truncated file, an I/O error) is a one-line
`FucinaError` naming the file, the expert and the reason.

Rejected: `madvise(WILLNEED)` on the mapped experts (the kernel's readahead still
decides what stays, and the cgroup still counts the pages as the process's), and a
second process for the reads (the reads already leave the GIL).
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from .errors import FucinaError

Key = tuple[int, int]                    # (layer, expert)


@dataclass
class CacheStats:
    """What the cache did (for `fucina bench`)."""

    hits: int = 0              # an expert wanted and in a slot (or being read ahead)
    misses: int = 0            # wanted, not there, read now (the step waited)
    prefetched: int = 0        # read ahead by the lookahead
    prefetch_hits: int = 0     # ... and then wanted (in the slot or in flight)
    bytes_read: int = 0

    @property
    def hit_rate(self) -> float:
        wanted = self.hits + self.misses
        return self.hits / wanted if wanted else 0.0

    @property
    def lookahead_rate(self) -> float:
        return self.prefetch_hits / self.prefetched if self.prefetched else 0.0


class ExpertCache:
    """`budget` bytes of expert slots over the file at `path`.

    `ranges[(layer, e)]`: the three (file offset, bytes) ranges of expert e's gate,
    up and down matrices in layer `layer`.  `acquire(layer, experts)` makes them
    resident (reading what is missing, in parallel) and returns their slots, busy
    until `release()`; `prefetch(layer, experts)` starts reads without waiting."""

    def __init__(self, path, ranges: dict[Key, list[tuple[int, int]]], budget: int, *,
                 threads: int = 8, pin_fraction: float = 0.25, repin_every: int = 256):
        self.path = str(path)
        self.ranges = ranges
        sizes = [sum(n for _, n in r) for r in ranges.values()]
        self.slot_bytes = max(sizes)
        self.n_slots = int(budget) // self.slot_bytes
        if self.n_slots < 1:
            raise FucinaError(f"an expert cache of {budget / 2**20:.2f} MiB holds no "
                              f"expert of {self.slot_bytes / 2**20:.2f} MiB")
        self.buffers = [np.empty(self.slot_bytes, np.uint8) for _ in range(self.n_slots)]
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * self.n_slots
        self.lru: OrderedDict[Key, None] = OrderedDict()   # resident, unpinned
        self.pinned: set[Key] = set()
        self.busy: set[int] = set()
        self.pending: dict[Key, Future] = {}
        self.ahead: set[Key] = set()          # prefetched, not yet wanted
        self.uses: Counter = Counter()
        self.n_pinned = int(self.n_slots * pin_fraction)
        self.repin_every, self._acquired = repin_every, 0
        # reads in flight at most when reading ahead: enough to keep the disk's queue
        # full, few enough that a step's own misses always find a slot
        self.max_ahead = min(4 * threads, max(2, self.n_slots // 4))
        self.stats = CacheStats()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._pool = ThreadPoolExecutor(max_workers=threads,
                                        thread_name_prefix="fucina-experts")
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self._fd)

    # --- the step's side ---------------------------------------------------------------

    def acquire(self, layer: int, experts, ahead=None) -> list[int]:
        """The slots of `experts` of `layer`, resident and busy (in that order).
        `ahead()`: called once the missing reads are started and before waiting for
        them (the lookahead: it may `prefetch` the next layer's)."""
        keys = [(layer, int(e)) for e in experts]
        for key in keys:
            self.uses[key] += 1
            if key in self.ahead:
                self.ahead.discard(key)
                self.stats.prefetch_hits += 1
            if key in self.slot_of:         # resident, or read ahead and in flight
                self.stats.hits += 1
                self._touch(key)
            else:
                self.stats.misses += 1
                self._start(key)
            self.busy.add(self.slot_of[key])
        if ahead is not None:
            ahead()
        for key in keys:
            self._wait(key)
        self._acquired += 1
        if self.repin_every and self._acquired % self.repin_every == 0:
            self._repin()
        return [self.slot_of[k] for k in keys]

    def release(self) -> None:
        self.busy.clear()

    def prefetch(self, layer: int, experts) -> None:
        """Start reading the experts of `layer` that are not resident (no wait)."""
        for e in experts:
            key = (layer, int(e))
            if key in self.slot_of or key in self.pending:
                continue
            in_flight = sum(1 for k in self.pending if k in self.ahead)
            if in_flight >= self.max_ahead or self._free_slot(dry=True) is None:
                return                          # the disk is busy enough, or no slot
            self.stats.prefetched += 1
            self.ahead.add(key)
            self._start(key)

    # --- slots -------------------------------------------------------------------------

    def _touch(self, key: Key) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def _free_slot(self, dry: bool = False) -> int | None:
        """A slot to fill: an empty one, else the least recently used expert's that is
        neither pinned, busy nor being read."""
        for slot, key in enumerate(self.key_of):
            if key is None:
                return slot
        for key in self.lru:
            slot = self.slot_of[key]
            if slot not in self.busy and key not in self.pending:
                if not dry:
                    del self.lru[key]
                    del self.slot_of[key]
                    self.key_of[slot] = None
                    self.ahead.discard(key)
                return slot
        return None

    def _start(self, key: Key) -> None:
        slot = self._free_slot()
        busy = {self.key_of[s] for s in self.busy}
        while slot is None and (ahead := [k for k in self.pending if k not in busy]):
            self._wait(ahead[0])            # a read ahead finishes: its slot is free
            slot = self._free_slot()
        if slot is None:
            raise FucinaError(f"the expert cache's {self.n_slots} slots are all in use "
                              "by one step: give it a larger budget")
        self.slot_of[key], self.key_of[slot] = slot, key
        self.pending[key] = self._pool.submit(self._read, key, self.buffers[slot])

    def _wait(self, key: Key) -> None:
        future = self.pending.get(key)
        if future is None:
            return
        try:
            self.stats.bytes_read += future.result()
        except BaseException:
            slot = self.slot_of.pop(key)
            self.key_of[slot] = None
            self.pending.pop(key, None)
            raise
        del self.pending[key]
        if key not in self.pinned:
            self.lru[key] = None

    def _read(self, key: Key, buf: np.ndarray) -> int:
        """(A reader thread.)  Expert `key`'s three ranges into `buf`, back to back."""
        at = 0
        for offset, n in self.ranges[key]:
            view = memoryview(buf[at:at + n])
            got = 0
            try:
                while got < n:
                    k = os.preadv(self._fd, [view[got:]], offset + got)
                    if k <= 0:
                        raise OSError(f"end of file at byte {offset + got}")
                    got += k
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self._fd, offset, n, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                raise FucinaError(f"{self.path}: cannot read expert {key[1]} of layer "
                                  f"{key[0]} ({n} bytes at {offset}): {e}") from None
            at += n
        return at

    def _repin(self) -> None:
        """The `n_pinned` most used resident experts are pinned, the others LRU."""
        resident = [k for k in self.slot_of if k not in self.pending]
        best = set(sorted(resident, key=lambda k: -self.uses[k])[:self.n_pinned])
        for key in self.pinned - best:
            self.lru[key] = None
        for key in best - self.pinned:
            self.lru.pop(key, None)
        self.pinned = best


class StreamedExperts:
    """One MoE layer's experts as the cache serves them: `views(slots)` gives the
    `DenseFfn` over each slot's bytes, built once per (slot, format) and reused
    (a refilled slot changes its bytes, not its arrays)."""

    def __init__(self, layer: int, mapped: list, cache: ExpertCache, ahead=()):
        self.layer, self.cache = layer, cache
        self.ahead = list(ahead)              # [(layer, router)] to read ahead for
        self._template = mapped[0]
        self._views: dict[int, object] = {}

    def views(self, slots: list[int]) -> list:
        out = []
        for slot in slots:
            ffn = self._views.get(slot)
            if ffn is None:
                ffn = self._views[slot] = _view(self._template, self.cache.buffers[slot])
            out.append(ffn)
        return out


def _view(template, buf: np.ndarray):
    """A DenseFfn like `template` (one expert's gate/up/down) over `buf`'s bytes."""
    from .ffn import DenseFfn
    from .weights import FusedLinear, LinearWeight

    at, parts = 0, []
    for w in (*template.gate_up.parts, template.down):
        n = w.info.n_bytes
        parts.append(LinearWeight(replace(w.info, data=buf[at:at + n])))
        at += n
    return DenseFfn(FusedLinear(parts[:2]), parts[2])


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """"1.5G", "512M", "800MiB", "2GB", "1048576" -> bytes (binary units)."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise FucinaError(f"not a size: {str(text)[:40]!r} (say 2G, 512M or a "
                          "number of bytes)") from None
    if not value > 0 or value != value or value == float("inf"):
        raise FucinaError(f"a size must be a positive number, got {str(text)[:40]!r}")
    return int(value * _UNITS[unit])


def expert_ranges(gguf, moe_layers: dict[int, object]) -> dict[Key, list[tuple[int, int]]]:
    """(layer, expert) -> the file ranges of its gate, up and down matrices, from the
    mapped experts' views (each a slice of the file's one memory map)."""
    base = gguf.mapped_base()
    out = {}
    for layer, ffn in moe_layers.items():
        for e, expert in enumerate(ffn.experts):
            out[(layer, e)] = [
                (w.info.data.__array_interface__["data"][0] - base, w.info.n_bytes)
                for w in (*expert.gate_up.parts, expert.down)]
    return out


# Layers read ahead: the next layer's router (and the one after) applied to this
# layer's input.  Two kept the disk busier than one: more reads in flight at once.
LOOKAHEAD = 2

# What stays besides the dense weights when the budget is chosen for the reader: the
# interpreter, numpy, numba's compiled kernels, a step's workspace, a KV cache.
RUNTIME_BYTES = 512 << 20


def memory_allowed() -> int:
    """Bytes this process may use: the smallest of the machine's memory and its cgroup's
    limit (v1 `memory.limit_in_bytes` or v2 `memory.max`; the page cache counts)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return total
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "memory":
            limit = f"/sys/fs/cgroup/memory{where}/memory.limit_in_bytes"
        elif controllers == "":
            limit = f"/sys/fs/cgroup{where}/memory.max"
        else:
            continue
        try:
            value = open(limit).read().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total


def auto_budget(model, allowed: int | None = None) -> int | None:
    """The expert cache a MoE model needs to run in the memory allowed, or None when
    the whole file fits (mapped, as usual).  What is left for the experts once the
    dense weights and `RUNTIME_BYTES` are counted."""
    from .moe import MoeFfn

    moe = [layer.ffn for layer in model.layers if isinstance(layer.ffn, MoeFfn)]
    allowed = memory_allowed() if allowed is None else allowed
    size = model.gguf.size
    if not moe or size + RUNTIME_BYTES <= allowed:
        return None
    experts = sum(f.expert_nbytes * len(f.experts) for f in moe)
    budget = allowed - (size - experts) - RUNTIME_BYTES
    need = (moe[0].k + 1) * moe[0].expert_nbytes
    if budget < need:
        mib = 2**20
        raise FucinaError(
            f"{model.path.name} needs more memory than the {allowed / mib:.0f} MiB this "
            f"process may use: its dense weights ({(size - experts) / mib:.0f} MiB) and "
            f"the runtime (~{RUNTIME_BYTES / mib:.0f} MiB) leave {max(budget, 0) / mib:.0f}"
            f" MiB for the experts, which need {need / mib:.0f} MiB at least")
    return budget


def attach(model, budget: int, **options) -> ExpertCache:
    """Stream `model`'s experts through a cache of `budget` bytes (its MoE layers'
    `stream` set); the logits stay bit-identical."""
    from .moe import MoeFfn

    moe = {i: layer.ffn for i, layer in enumerate(model.layers)
           if isinstance(layer.ffn, MoeFfn)}
    if not moe:
        raise FucinaError(f"{model.path.name}: not a mixture-of-experts model: "
                          "--expert-cache streams experts")
    if any(len(f.experts[0].gate_up.parts) != 2 for f in moe.values()):
        raise FucinaError("expert streaming needs gate and up as two matrices")
    depth = options.pop("lookahead", LOOKAHEAD)
    cache = ExpertCache(model.path, expert_ranges(model.gguf, moe), budget, **options)
    k = next(iter(moe.values())).k
    if cache.n_slots < k + 1:
        cache.close()
        raise FucinaError(f"an expert cache of {budget / 2**20:.2f} MiB holds "
                          f"{cache.n_slots} experts; a token needs {k} at once (and one "
                          f"more to read ahead): give it at least "
                          f"{(k + 1) * cache.slot_bytes / 2**20:.2f} MiB")
    for i, ffn in moe.items():
        ahead = [(j, moe[j].router) for j in range(i + 1, i + 1 + depth) if j in moe]
        ffn.stream = StreamedExperts(i, ffn.experts, cache, ahead)
    return cache
