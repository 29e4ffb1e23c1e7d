"""`fucina serve`: the flags checked, the model loaded, the OpenAI-compatible server
(server.py) run until Ctrl-C.  The steps the commands share are in commands.py."""

from __future__ import annotations

import os
import sys

from .commands import (check_expert_top_p, check_speculation_flags, first_start,
                       load_model_for, speculator_for)
from .errors import FucinaError


def cmd_serve(args) -> int:
    """`fucina serve`: check the flags, load the model, bind the port, serve until
    Ctrl-C or SIGTERM (which cancel the running requests: exit code 0).  If the
    engine fails (a bug), `Server.run` raises a `FucinaError`: one line, exit 1."""
    try:                   # the `serve` extra: pip install 'fucina_course[serve]'
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise FucinaError(f"fucina serve needs the serve extra ({err.name} is missing): "
                          "pip install -e '.[serve]' (or -r requirements.txt)") from err
    from .server import Server, is_loopback, normalize_origin

    if args.parallel < 1:
        raise FucinaError(f"--parallel must be at least 1, got {args.parallel}")
    if args.queue is not None and args.queue < 0:
        raise FucinaError(f"--queue must be at least 0, got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise FucinaError(f"--port must be in 0 .. 65535, got {args.port}")
    if args.ctx is not None and args.ctx < 2:
        raise FucinaError(f"--ctx must be at least 2, got {args.ctx}")
    api_key = args.api_key or os.environ.get("FUCINA_API_KEY") or None
    origins = _names(args.cors_origins)
    for origin in origins:                          # before the model is loaded
        normalize_origin(origin)
    check_expert_top_p(args)
    check_speculation_flags(args)
    model = load_model_for(args)
    if model.tokenizer is None:
        raise FucinaError(f"{model.path}: no tokenizer in the file: it cannot serve")
    if args.ctx is not None and args.ctx > model.config.context_length:
        raise FucinaError(f"--ctx {args.ctx} exceeds the model's context of "
                          f"{model.config.context_length} positions")
    from .catalog import DEFAULT_MODEL, NAMED_MODELS

    name = args.model or os.environ.get("FUCINA_MODEL") or DEFAULT_MODEL
    model_id = name if name in NAMED_MODELS else model.path.stem   # what clients send
    server = Server(model, model_id=model_id, host=args.host, port=args.port,
                    parallel=args.parallel, ctx=args.ctx, cache_type=args.cache_type,
                    queue_size=args.queue, api_key=api_key,
                    speculator=speculator_for(args, model, args.ctx or min(
                        model.config.context_length, 4096)),
                    cors_origins=origins,
                    allow_hosts=_names(args.allow_hosts))
    first_start(model)
    if not is_loopback(args.host) and api_key is None:
        print(f"fucina: warning: listening on {args.host} without --api-key: anyone "
              "who can reach this port can use the model", file=sys.stderr)
    if "*" in origins and api_key is None:
        print("fucina: warning: --cors-origins '*' without --api-key: any web page "
              "you visit can use the model", file=sys.stderr)
    sched = server.scheduler
    print(f"fucina: serving {model_id} at {server.url}/v1 ({sched.parallel} slots of "
          f"{sched.capacity} positions, queue {sched.queue_size}"
          f"{', API key required' if api_key else ''}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    server.run()
    print("fucina: server stopped", file=sys.stderr, flush=True)
    return 0


def _names(value: str) -> list[str]:
    """A comma-separated flag -> its non-empty items."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]
