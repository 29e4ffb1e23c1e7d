"""`fucina serve` vs llama-cpp-python's OpenAI server: concurrent streaming clients.

    python bench/bench_serve.py [--model MODEL] [--threads 2] [--clients 1,4,8]
        [--max-tokens 64] [--rounds 3] [--ctx 2048] [--json OUT]

Issue 25, item 7.  The same GGUF (default: the cached default model,
`catalog.resolve("qwen2.5-coder-0.5b")`; MODEL is a path or a named model, see
`fucina models list`) and the same thread count, served in turn -- never both at once:

- `fucina serve MODEL --threads T --parallel MAX_CLIENTS --ctx C` (continuous batching:
  concurrent requests are decoded together);
- `python -m llama_cpp.server --model MODEL --n_threads T --n_threads_batch T --n_ctx C
  --interrupt_requests False` (one request at a time behind a lock; the flag stops a
  waiting request from cutting the running one short, which it does by default).

Each server runs in its own subprocess on a free loopback port (its log in a temporary
file, printed if it fails).  Once it answers, a warm-up: one request, then one burst
at the largest client count.  Then, for each client count N, R rounds: N threads, each
with its own official `openai` client, start together (a barrier) and stream one chat
completion each (temperature 0, `max_tokens` fixed, a distinct prompt per client and
per round, so neither server's prefix cache makes a round trivial; the chat template's
system prompt is shared, and both servers may reuse it).  Per round:

- tokens/s = all clients' completion tokens / wall time from the barrier to the last
  stream's end.  Completion tokens: the `usage` of the final chunk where the server
  sends one (`stream_options.include_usage`, fucina), else the number of deltas that
  carry text (llama-cpp-python streams one token per delta).
- time to first token (TTFT): request sent -> first delta with text, per client; the
  round's median.

The table gives, per client count, the best round's tokens/s (best of R) and the
lowest round-median TTFT; `--json OUT` keeps every round.  The ratio is
fucina / llama-cpp-python.  CPU: the model name, family and x86-64 level from
/proc/cpuinfo (`quant.isa`), fucina's kernel level (`fucina_course.quant.isa.level`)
and the llama.cpp build's best instruction set (`llama_print_system_info`).

Needs llama-cpp-python's server extras (`pip install 'llama-cpp-python[server]'`, or
the pins in requirements-dev.txt: sse-starlette, starlette-context, pydantic-settings).
On a shared virtual machine whose speed drifts, compare ratios from one run, and run
on a quiet machine for numbers worth publishing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASKS = [
    "reverses a linked list", "checks whether a string is a palindrome",
    "merges two sorted lists", "computes the n-th Fibonacci number iteratively",
    "parses an ISO 8601 date", "counts the words in a text file",
    "flattens a nested list", "finds the longest common prefix of some strings",
    "converts Roman numerals to integers", "transposes a matrix",
    "removes duplicates from a list keeping the order", "validates an IPv4 address",
    "computes a moving average", "groups a list of words by their anagram",
    "runs a binary search", "encodes a string with run-length encoding",
]
LANGS = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "Ruby", "Haskell"]


def prompt(i: int) -> str:
    """The i-th prompt: distinct for every i (task x language x a number)."""
    task = TASKS[i % len(TASKS)]
    lang = LANGS[(i // len(TASKS)) % len(LANGS)]
    return (f"Write a {lang} function named f{i} that {task}. "
            "Explain it briefly, then show an example call.")


# --- the machine ------------------------------------------------------------------

def cpu_info() -> dict:
    from fucina_course.quant.isa import cpu_family, cpu_flags, cpu_name

    name, flags = f"{cpu_name()} ({cpu_family()})", cpu_flags()
    v2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
    v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
    v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    level = "?"
    if flags:
        level = "x86-64"
        for tag, need in (("v2", v2), ("v3", v3), ("v4", v4)):
            if not need <= flags:
                break
            level = f"x86-64-{tag}"
    extra = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    isa = level + (f" (+{', '.join(extra)})" if extra else "")
    fucina_level = "?"
    try:
        from fucina_course.quant import isa as fisa

        fucina_level = fisa.level
    except Exception as exc:  # noqa: BLE001 -- reported, not fatal
        fucina_level = f"? ({exc.__class__.__name__})"
    llama_isa = "?"
    try:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        on = {f.split("=")[0].strip() for f in info.split("|")
              if f.strip().endswith("= 1")}
        best = [f for f in ("AVX512_VNNI", "AVX512", "AVX_VNNI", "AVX2", "AVX") if f in on]
        llama_isa = best[0] if best else "no AVX"
    except Exception:  # noqa: BLE001
        pass
    return {"cpu": name, "cores": os.cpu_count(), "isa": isa,
            "fucina_level": fucina_level, "llama_cpp_isa": llama_isa}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the servers --------------------------------------------------------------------

LLAMA_EXTRAS = {"fastapi": "fastapi", "uvicorn": "uvicorn",
                "sse_starlette": "sse-starlette", "starlette_context": "starlette-context",
                "pydantic_settings": "pydantic-settings", "yaml": "PyYAML"}


def llama_server_missing() -> str | None:
    """Why `python -m llama_cpp.server` cannot start here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (scripts/install_llama_cpp.sh builds "
                "it from source)")
    missing = [pkg for mod, pkg in LLAMA_EXTRAS.items()
               if importlib.util.find_spec(mod) is None]
    if missing:
        return ("llama-cpp-python's server needs its [server] extras, missing here: "
                f"{', '.join(missing)}.  Install them with\n"
                f"    {sys.executable} -m pip install {' '.join(missing)}\n"
                "(pinned in requirements-dev.txt), or "
                "pip install 'llama-cpp-python[server]'")
    return None


def server_command(kind: str, model: str, threads: int, port: int, parallel: int,
                   ctx: int) -> list[str]:
    if kind == "fucina":
        return [sys.executable, "-m", "fucina_course", "serve", model,
                "--port", str(port), "--threads", str(threads),
                "--parallel", str(parallel), "--ctx", str(ctx)]
    return [sys.executable, "-m", "llama_cpp.server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
            "--interrupt_requests", "False", "--verbose", "False"]


class ServerFailed(Exception):
    pass


class Served:
    """A server subprocess: started, waited for, stopped (see `stop`)."""

    def __init__(self, kind: str, cmd: list[str], port: int, threads: int,
                 timeout: float):
        self.kind, self.cmd, self.port, self.timeout = kind, cmd, port, timeout
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench_serve_{kind}_",
                                               suffix=".log", delete=False)
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads),
                   OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
        self.base = f"http://127.0.0.1:{port}"

    def tail(self, n: int = 25) -> str:
        try:
            with open(self.log.name, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self) -> str:
        """Polls until the server lists its model; returns the model id."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.kind} server exited with code "
                                   f"{self.proc.returncode} before answering.\n"
                                   f"command: {' '.join(self.cmd)}\n"
                                   f"its last output ({self.log.name}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/v1/models", timeout=5) as r:
                    data = json.load(r)
                return data["data"][0]["id"]
            except (urllib.error.URLError, ConnectionError, OSError, ValueError,
                    KeyError, IndexError):
                time.sleep(0.5)
        raise ServerFailed(f"{self.kind} server did not answer within "
                           f"{self.timeout:.0f} s.\ncommand: {' '.join(self.cmd)}\n"
                           f"its last output ({self.log.name}):\n{self.tail()}")

    def stop(self) -> None:
        """fucina: SIGTERM (it cancels what runs and exits 0).  llama_cpp.server:
        SIGINT, Ctrl-C (its uvicorn shuts down as gracefully on SIGTERM, then
        re-raises it: exit code -15)."""
        if self.proc.poll() is None:
            sig = signal.SIGTERM if self.kind == "fucina" else signal.SIGINT
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                print(f"  {self.kind} server ignored {sig.name} for 20 s: killed",
                      file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# --- the clients --------------------------------------------------------------------

def one_stream(base: str, model_id: str, text: str, max_tokens: int, usage: bool,
               barrier: threading.Barrier, out: list, idx: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="bench", max_retries=0,
                    timeout=900)
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    rec = {"ttft": None, "deltas": 0, "usage": None, "error": None, "chars": 0}
    try:
        barrier.wait()
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": text}],
            stream=True, temperature=0, max_tokens=max_tokens, **extra)
        for chunk in stream:
            if chunk.usage is not None and chunk.usage.completion_tokens:
                rec["usage"] = chunk.usage.completion_tokens
            for choice in chunk.choices or []:
                delta = choice.delta
                piece = (getattr(delta, "content", None) or "") + (
                    getattr(delta, "reasoning_content", None) or "")
                if piece:
                    if rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
                    rec["deltas"] += 1
                    rec["chars"] += len(piece)
        rec["end"] = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 -- a failed client fails the round, below
        rec["error"] = f"{exc.__class__.__name__}: {exc}"
    finally:
        client.close()
    out[idx] = rec


def burst(base: str, model_id: str, prompts: list[str], max_tokens: int,
          usage: bool) -> dict:
    """len(prompts) concurrent streams, started together; the round's numbers."""
    n = len(prompts)
    out: list = [None] * n
    barrier = threading.Barrier(n + 1)
    threads = [threading.Thread(target=one_stream, daemon=True,
                                args=(base, model_id, p, max_tokens, usage, barrier,
                                      out, i))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    errors = [r["error"] for r in out if r["error"]]
    if errors:
        raise ServerFailed(f"{len(errors)} of {n} clients failed: {errors[0]}")
    wall = max(r["end"] for r in out) - t0
    tokens = sum(r["usage"] if r["usage"] is not None else r["deltas"] for r in out)
    ttfts = [r["ttft"] for r in out if r["ttft"] is not None]
    return {"clients": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_s": ttfts,
            "counted_from": ("usage" if all(r["usage"] is not None for r in out)
                             else "deltas")}


def bench_server(kind: str, args, path: str, clients: list[int]) -> dict:
    port = free_port()
    cmd = server_command(kind, path, args.threads, port, max(clients), args.ctx)
    print(f"== {kind}: starting ({' '.join(cmd[1:])})", file=sys.stderr, flush=True)
    srv = Served(kind, cmd, port, args.threads, args.start_timeout)
    usage = kind == "fucina"        # llama-cpp-python 0.3 ignores include_usage
    result: dict = {"server": kind, "command": cmd, "rounds": {}}
    try:
        t = time.perf_counter()
        model_id = srv.wait_ready()
        result["model_id"] = model_id
        result["ready_s"] = time.perf_counter() - t
        print(f"   ready in {result['ready_s']:.1f} s (model id {model_id!r}); "
              "warming up", file=sys.stderr, flush=True)
        serial = 0      # the same prompts, in the same order, for every server
        burst(srv.base, model_id, [prompt(serial)], args.max_tokens, usage)
        burst(srv.base, model_id, [prompt(serial + 1 + i) for i in range(max(clients))],
              min(args.max_tokens, 8), usage)
        serial += 1000
        for n in clients:
            rounds = result["rounds"].setdefault(str(n), [])
            for r in range(args.rounds):
                got = burst(srv.base, model_id, [prompt(serial + i) for i in range(n)],
                            args.max_tokens, usage)
                serial += n
                rounds.append(got)
                print(f"   {n:>2} clients, round {r + 1}: {got['tok_s']:7.2f} tok/s "
                      f"({got['tokens']} tokens in {got['wall_s']:.2f} s), median TTFT "
                      f"{got['ttft_median_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        srv.stop()
        print(f"   {kind} server stopped (exit code {srv.proc.returncode})",
              file=sys.stderr, flush=True)
        try:
            os.unlink(srv.log.name)
        except OSError:
            pass
    return result


def summary(res: dict | None, n: int) -> tuple[float | None, float | None]:
    if not res or str(n) not in res["rounds"]:
        return None, None
    rounds = res["rounds"][str(n)]
    ttfts = [r["ttft_median_s"] for r in rounds if r["ttft_median_s"] is not None]
    return max(r["tok_s"] for r in rounds), (min(ttfts) if ttfts else None)


def main() -> None:
    ap = argparse.ArgumentParser(
        description="fucina serve vs llama-cpp-python's server: concurrent streaming "
                    "clients, total tokens/s and time to first token")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="GGUF path or named model (default qwen2.5-coder-0.5b)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,4,8",
                    help="concurrent client counts, comma-separated (default 1,4,8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="best of R (default 3)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="context positions (fucina: per slot; llama.cpp: n_ctx)")
    ap.add_argument("--servers", default="fucina,llama-cpp-python",
                    help="which servers to run, in this order")
    ap.add_argument("--start-timeout", type=float, default=600,
                    help="seconds to wait for a server to answer (default 600)")
    ap.add_argument("--json", metavar="OUT", help="write every round's results here")
    args = ap.parse_args()

    try:
        clients = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"--clients: expected integers like 1,4,8, got {args.clients!r}")
    if not clients or min(clients) < 1:
        raise SystemExit("--clients: every count must be at least 1")
    if args.rounds < 1 or args.max_tokens < 1 or args.threads < 1:
        raise SystemExit("--rounds, --max-tokens and --threads must be at least 1")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in servers if s not in ("fucina", "llama-cpp-python")]
    if bad or not servers:
        raise SystemExit(f"--servers: expected fucina and/or llama-cpp-python, got {bad}")
    if importlib.util.find_spec("openai") is None:
        raise SystemExit("the official openai client is needed: "
                         f"{sys.executable} -m pip install -r requirements-dev.txt")
    if "llama-cpp-python" in servers:
        why = llama_server_missing()
        if why:
            raise SystemExit(f"bench_serve: cannot start llama_cpp.server: {why}")

    sys.path.insert(0, ROOT)
    if os.path.exists(args.model):
        path = os.path.abspath(args.model)
    else:
        from fucina_course.catalog import resolve

        try:
            path = str(resolve(args.model))
        except Exception as exc:  # noqa: BLE001
            raise SystemExit(f"bench_serve: cannot resolve model {args.model!r}: {exc}")
    if not os.path.isfile(path):
        raise SystemExit(f"bench_serve: {args.model!r}: no such model file ({path})")
    machine = cpu_info()
    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict = {}
    try:
        for kind in servers:
            results[kind] = bench_server(kind, args, path, clients)
    except ServerFailed as exc:
        raise SystemExit(f"bench_serve: {exc}")
    except KeyboardInterrupt:
        raise SystemExit("bench_serve: interrupted (the server was stopped)")

    header = (f"{started:%Y-%m-%d %H:%M} UTC - {machine['cpu']}, {machine['cores']} cores, "
              f"{machine['isa']}; fucina kernels {machine['fucina_level']}, llama.cpp "
              f"build {machine['llama_cpp_isa']}; threads={args.threads}; "
              f"{os.path.basename(path)}; max_tokens={args.max_tokens}, temperature 0, "
              f"best of {args.rounds} round(s); Python {platform.python_version()}")
    print("\n" + header + "\n")
    fu, ll = results.get("fucina"), results.get("llama-cpp-python")
    print("| clients | fucina tok/s | llama-cpp-python tok/s | ratio | "
          "fucina TTFT s | llama-cpp-python TTFT s |")
    print("|---:|---:|---:|---:|---:|---:|")

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    rows = []
    for n in clients:
        (a, ta), (b, tb) = summary(fu, n), summary(ll, n)
        ratio = a / b if a and b else None
        rows.append({"clients": n, "fucina_tok_s": a, "llama_cpp_python_tok_s": b,
                     "ratio": ratio, "fucina_ttft_s": ta, "llama_cpp_python_ttft_s": tb})
        print(f"| {n} | {fmt(a, '.2f')} | {fmt(b, '.2f')} | {fmt(ratio, '.2f')} | "
              f"{fmt(ta, '.2f')} | {fmt(tb, '.2f')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": started.isoformat(), "machine": machine,
                       "threads": args.threads, "model": path,
                       "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "ctx": args.ctx, "python": platform.python_version(),
                       "summary": rows, "servers": results}, f, indent=1)
        print(f"\n(every round in {args.json})")


if __name__ == "__main__":
    main()
