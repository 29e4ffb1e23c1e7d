"""Decode on ARM machines no session runs on, estimated from bytes and bandwidth (issue 47).

    python bench/arm_decode_estimate.py [MODEL ...]      # default: the two wheel models

Decoding one token reads every weight the forward pass uses once (the dense layers, and
the output matrix; of the embedding table, one row), so a token cannot be decoded faster
than the memory delivers those bytes:  tokens/s <= bandwidth / bytes per token.  On x86
the engine decodes at 87% of the streaming-read bandwidth measured on the same machine
(AMD Zen 5, docs/BENCHMARKS.md), and llama.cpp runs into the same wall, so for decode
the question on ARM is not whose kernels are faster but who gets closer to the wall.
That cannot be predicted statically; this script only says where the wall is, from
each machine's published memory bandwidth:

* Apple M1: LPDDR4X-4266 on a 128-bit bus, 68.25 GB/s (Apple's M1 specifications);
* Apple M2: LPDDR5-6400 on a 128-bit bus, 100 GB/s (Apple's M2 announcement);
* AWS Graviton2 (Neoverse N1): 8 channels of DDR4-3200, 204.8 GB/s a socket;
* AWS Graviton3 (Neoverse V1): 8 channels of DDR5-4800, 307.2 GB/s a socket;
* Raspberry Pi 5 (Cortex-A76): LPDDR4X-4267 on a 32-bit bus, 17.1 GB/s.

A server socket's figure is shared by its 64 cores: the few threads of a cloud VM reach
a fraction of it, so the server rows are ceilings, not expectations.  Prefill, which is compute-bound, is
estimated by the kernels' MACs per cycle instead (bench/mca_prefill.py --arm).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (name, GB/s published, what the figure is)
MACHINES = (
    ("Apple M1", 68.25, "laptop"),
    ("Apple M2", 100.0, "laptop"),
    ("Raspberry Pi 5 (Cortex-A76)", 17.1, "board"),
    ("Graviton2 (Neoverse N1)", 204.8, "socket, shared by 64 cores"),
    ("Graviton3 (Neoverse V1)", 307.2, "socket, shared by 64 cores"),
)


def bytes_per_token(path: str) -> int:
    """Weight bytes one decoded token reads: every tensor, except that of the token
    embedding table only one row is read unless the output matrix is tied to it."""
    from fucina_course.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    tensors = gguf.tensors                                   # name -> TensorInfo
    total = sum(t.n_bytes for t in tensors.values())
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and "output.weight" in tensors:   # untied: one row read
        total -= embedding.n_bytes - embedding.n_bytes // embedding.rows
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["qwen2.5-coder-0.5b", "smollm2-135m"])
    args = ap.parse_args()
    from fucina_course.catalog import resolve

    sizes = {m: bytes_per_token(str(resolve(m))) for m in args.models}
    print("| machine | memory bandwidth (published) | "
          + " | ".join(f"{m} ({sizes[m] / 1e6:.0f} MB a token): decode ceiling"
                       for m in args.models) + " |")
    print("|---|---:|" + "---:|" * len(args.models))
    for name, gb_s, what in MACHINES:
        ceilings = " | ".join(f"{gb_s * 1e9 / sizes[m]:.0f} tok/s" for m in args.models)
        print(f"| {name} | {gb_s:g} GB/s ({what}) | {ceilings} |")


if __name__ == "__main__":
    main()
