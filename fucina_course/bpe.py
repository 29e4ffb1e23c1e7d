"""BPE on one pre-token chunk: fuse adjacent pairs by merge rank, lowest first.

`bpe_merge` is step 3 of the tokenizer's pipeline (tokenizer.py's docstring lists all
four).  It knows nothing of vocabularies or GGUF files: it takes a chunk's bytes and the
ranks of the merges, `(left bytes, right bytes) -> rank`, and returns the parts.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from .errors import TokenizerError

# The longest pre-token chunk BPE will merge: 256 KiB.  Why a cap, why this value:
# `bpe_merge` is O(n log n) but pure Python, ~2-4 us and ~150 bytes of transient memory
# per byte of a long chunk.  The worst chunk under the cap, 262,144 spaces (the most
# heap traffic per byte: ~4 keys, near the bound of `bpe_merge`), took 0.6 s (1.0 s
# with another job on the second core) and 37 MiB on a 2-core AVX-512 machine; 1 MiB of
# spaces took 4.5 s and 146 MiB.  Real text never comes near it: the longest chunk of
# bench/bench_tokenize.py's 1 MB of code and prose is 78 bytes, and a 200 KB
# one-letter prompt still tokenizes, exactly, in 0.35 s.  What is refused is one run of
# a character class longer than 256 KiB (one letter, spaces, dashes, a genome pasted
# with no line break): llama.cpp would give ids for it, we raise a `TokenizerError`
# naming this limit rather than hold the process.  Below the cap the ids are exact.
# Rejected: cutting an over-long chunk into pieces (ids silently differ from
# llama.cpp's), and no cap at all (a 10 MB run would hold the GIL for ~40 s and take
# ~1.5 GB, extrapolating the figures above).
MAX_CHUNK_BYTES = 1 << 18
_ONE_BYTE = [bytes([b]) for b in range(256)]
# Links of a chunk's parts as built for short chunks: slices of one shared list
# (prv = _LINKS[:n], nxt = _LINKS[2:n + 2]) instead of two fresh `range` lists.
_LINKS = list(range(-1, 4098))


def bpe_merge(chunk: bytes, ranks: dict[tuple[bytes, bytes], int]
              ) -> tuple[list[bytes], int]:
    """BPE on one chunk: (its parts, the steps taken).

    The rule: start from single bytes and repeatedly fuse the adjacent pair with the
    lowest rank in `ranks`, the leftmost among equal ranks, until no adjacent pair has
    a rank.  `_heap_merge` applies it in O(n log n) for n bytes (its docstring says
    how).

    Why: the loop this replaced kept a list of pair ranks and found each merge with
    `min` + `list.index` (in C) and a splice, O(n) per merge and O(n^2) per chunk.  A
    long run of one character class is one chunk, so 20,000 x "a" took 2,672 ms
    (llama.cpp 22 ms) and a 200 KB one-letter prompt held a server for six minutes; the
    heap takes ~25 ms for the 20,000.  Rejected: keeping the old loop for short chunks
    behind a size threshold.  On the 33,204 distinct chunks of bench/bench_tokenize.py's
    1 MB text (5.8 bytes on average) `Tokenizer.bpe` costs 2% more than the loop did
    (5.01 against 4.90 us a chunk, best of 11 interleaved runs; a cold `encode_raw` of
    the whole 1 MB, 408 against 401 ms), too little to keep two implementations.

    `steps` is n plus the number of keys popped (stale ones included): the work, in a
    unit a test can pin (4x the bytes, ~4x the steps) without timing anything.
    Counting it is one integer add per pop.  A chunk longer than `MAX_CHUNK_BYTES` is a
    `TokenizerError` before any work.
    """
    n = len(chunk)
    if n < 2:
        return ([chunk] if n else []), n
    if n > MAX_CHUNK_BYTES:
        raise TokenizerError(f"a pre-token chunk of {n:,} bytes (starting "
                             f"{chunk[:16]!r}) is longer than MAX_CHUNK_BYTES "
                             f"({MAX_CHUNK_BYTES:,}): one run of a character class "
                             "that long is refused")
    parts: list = list(map(_ONE_BYTE.__getitem__, chunk))
    steps = n + _heap_merge(parts, ranks)
    return list(filter(None, parts)), steps


def _heap_merge(parts: list, ranks: dict[tuple[bytes, bytes], int]) -> int:
    """Apply the rule to `parts` (n >= 2 single bytes) in place: a part fused into its
    left neighbour becomes None.  Returns the number of heap keys popped.

    How, in O(n log n): the parts form a doubly linked list, each part named by the
    offset of its first byte (`nxt`, `prv`, `parts`).  Every adjacent pair that has a
    rank is a heap key `rank << shift | offset`, so the smallest key is the lowest rank
    and, among equal ranks, the leftmost pair: the rule's order.  A merge changes only
    the pairs on either side of the new part; their new keys are pushed and the old
    ones stay in the heap, skipped when popped (lazy deletion: `cur[i]` is the rank of
    the pair starting at offset i now, None if none).  The invariant: every current
    pair with a rank has its key in the heap.  So a popped key whose rank is `cur[i]`
    is the current pair's own key, the smallest of all current candidates, whichever
    push it came from; any other popped key is stale.  Each merge pushes at most two
    keys: at most 3n keys pass through the heap.  (llama.cpp's llm_tokenizer_bpe and
    HF tokenizers' `Word::merge_all` work the same way.)
    """
    n = len(parts)
    get = ranks.get
    cur = list(map(get, zip(parts, parts[1:])))
    cur.append(None)                      # the last part has no right neighbour
    shift = n.bit_length()
    mask = (1 << shift) - 1
    heap = [(r << shift) | i for i, r in enumerate(cur) if r is not None]
    heapify(heap)
    links = _LINKS if n + 2 <= len(_LINKS) else list(range(-1, n + 1))
    prv, nxt = links[:n], links[2:n + 2]  # offset of the previous / next part (n: end)
    pop, push = heappop, heappush
    popped = 0
    while heap:
        key = pop(heap)
        popped += 1
        i = key & mask
        if cur[i] != key >> shift:        # stale: the pair at i changed since
            continue
        j = nxt[i]
        merged = parts[i] + parts[j]
        parts[i] = merged
        parts[j] = cur[j] = None          # part j is gone
        k = nxt[i] = nxt[j]
        if k < n:
            prv[k] = i
            r = cur[i] = get((merged, parts[k]))
            if r is not None:
                push(heap, (r << shift) | i)
        else:
            cur[i] = None
        p = prv[i]
        if p >= 0:
            r = cur[p] = get((parts[p], merged))
            if r is not None:
                push(heap, (r << shift) | p)
    return popped
