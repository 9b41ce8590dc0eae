"""``medusa-serve``: an OpenAI-compatible HTTP server with Medusa decoding.

    medusa-serve --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi!"}]}'

Endpoints: /v1/chat/completions, /v1/completions (streaming with ``"stream": true``), /v1/models,
/tokenize, /detokenize, /health, /metrics (Prometheus). One engine decodes every request (`medusa_jax.engine.engine`):
requests share its rows (``--max-batch``), stream their tokens as steps accept them, reuse the
KV cache of a conversation's earlier turns, and speculate as the load allows (``--speculation``).
The port is bound before the model loads (a port in use is said at once, exit 1).
SIGTERM or Ctrl-C: the server stops taking requests, lets running ones finish for
``--shutdown-grace`` seconds, ends the rest, and exits 0.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import List, Optional

from medusa_jax.cli import interruptible

#: `serve.tools.TOOL_PARSERS`' names (named here so that --help does not import the server; a test
#: keeps the two equal).
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "pythonic", "mistral")


def build_parser() -> argparse.ArgumentParser:
    from medusa_jax.cli import common
    from medusa_jax.engine.chooser import SPECULATION

    p = argparse.ArgumentParser(prog="medusa-serve", description="Serve the model over an OpenAI-compatible HTTP "
                                "API, decoding with Medusa heads.", formatter_class=common.HelpFormatter)
    common.add_model_args(p)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send in 'model' (default: the model file's name, lower case, "
                        "without its extension and GGUF quantization suffix)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (the engine's rows)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a row; beyond it the server answers 429 with Retry-After")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="answer budget of a request without max_tokens (default: the rest of the context for a "
                        "chat, 16 tokens for /v1/completions, as OpenAI and vLLM)")
    p.add_argument("--max-request-mb", type=float, default=16.0,
                   help="largest request body accepted, in MiB; a larger one gets 413 (nothing past the limit is kept)")
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="memory for reusing conversations' KV caches across turns, in MiB (0: off)")
    p.add_argument("--speculation", choices=SPECULATION, default="adaptive",
                   help="'adaptive': each step takes plain, a smaller or the full tree, whichever is measured "
                        "fastest for the rows now decoding; 'always': the full tree; 'off': plain decoding")
    p.add_argument("--acceptance", choices=("exact", "typical"), default="exact",
                   help="how sampled requests accept candidates: 'exact' keeps the model's distribution (and "
                        "gives plain sampling's tokens for a seed); 'typical' accepts more and changes it")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests may take to finish after SIGTERM or Ctrl-C (>= 0); the server "
                        "stops listening at once (new connections are refused, idle ones closed), and requests "
                        "still running shortly before the grace ends (min(2 s, half of it)) get the "
                        "server_shutdown error")
    p.add_argument("--allowed-origins", default="*",
                   help="web origins whose pages may call the API from a browser (CORS), comma-separated or a "
                        "JSON list as vLLM takes them, e.g. http://localhost:3000; '*' (the default, as vLLM's): any "
                        "origin; '': none")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=None,
                   help="how the model writes a tool call, so that chats with 'tools' get them back as tool_calls "
                        "(vLLM's names): 'hermes' for <tool_call>{...}</tool_call> (Qwen2.5, Qwen3, Hermes), "
                        "'llama3_json' for a JSON call (Llama 3.1-3.3), 'pythonic' for [f(a=1), g()] (Llama 3.2 "
                        "and 4 with a pythonic template), 'mistral' for [TOOL_CALLS][{...}] (Mistral); default: "
                        "none (a chat with tools must then give tool_choice 'none')")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="render a chat with tool_choice 'none' without its tools (vLLM's flag), so that the model, "
                        "shown none, writes a message as OpenAI's 'none' promises; by default the template shows "
                        "them (vLLM's default) and a call the model writes anyway comes back as content")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the tokenizer's own (e.g. one that renders "
                        "tools); its end-of-turn token also ends answers")
    common.add_dtype_arg(p)
    common.add_mesh_arg(p)
    common.add_lookup_arg(p)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    return p


def default_model_name(path: str) -> str:
    """The model id to serve under by default: the file or directory name, lower case, without a
    GGUF quantization suffix ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "smollm2-135m-instruct")."""
    stem = os.path.basename(path.rstrip("/"))
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    return re.sub(r"[.-](q\d[a-z0-9_]*|f16|f32|bf16)$", "", stem.lower())


@interruptible
def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("max_batch", "max_waiting"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.prefix_cache_mb < 0:
        p.error(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if not (math.isfinite(args.max_request_mb) and args.max_request_mb > 0):
        p.error(f"--max-request-mb must be a number of MiB > 0, got {args.max_request_mb}")
    if not (math.isfinite(args.shutdown_grace) and args.shutdown_grace >= 0):
        p.error(f"--shutdown-grace must be a finite number of seconds >= 0, got {args.shutdown_grace}")
    try:
        origins = parse_origins(args.allowed_origins)
    except ValueError as e:  # (json's errors are ValueErrors too)
        p.error(f"--allowed-origins {args.allowed_origins}: {e}")
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--chat-template {args.chat_template}: {getattr(e, 'strerror', None) or e}")
        if not template.strip():
            p.error(f"--chat-template {args.chat_template}: the file is empty")

    try:  # before the slow model load: a port already taken fails at once, in one line
        sock = bind_port(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    import uvicorn

    from medusa_jax import resolve
    from medusa_jax.chat import render_chat
    from medusa_jax.convert.load import complete_eos_ids, weights_of
    from medusa_jax.cli import common
    from medusa_jax.engine.engine import Engine
    from medusa_jax.serve import create_app

    try:
        model, heads, tree, note, _ = common.setup_decoding(args, use_medusa=not args.no_medusa)
    except (OSError, ValueError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}", file=sys.stderr)
    eos = None
    if template is not None:
        model.tokenizer.chat_template = template
        try:
            render_chat(model.tokenizer, [{"role": "user", "content": "Hello"}])
        except Exception as e:  # noqa: BLE001 - Jinja's errors, or the template's own raise_exception
            print(f"error: --chat-template {args.chat_template}: the template cannot render a user message: {e}",
                  file=sys.stderr)
            sock.close()
            return 2
        eos = complete_eos_ids(model.cfg, model.tokenizer).eos_token_ids
    priors = None
    calibration = resolve.heads_calibration(args.heads, weights_of(model.params))
    predicted = resolve.predicted_tokens_per_step(tree, calibration) if heads else None
    if predicted:
        priors = [1.0, 1.0 + (predicted[0] - 1.0) / 2, predicted[0]]
    engine = Engine(model.cfg, model.params, heads=heads, tree=tree, max_batch=args.max_batch,
                    speculation=args.speculation, acceptance=args.acceptance,
                    prefix_cache_bytes=args.prefix_cache_mb << 20, priors=priors, eos_token_ids=eos)
    if priors is not None and len(priors) != len(engine.chooser.trees):
        engine.chooser.gain = [1.0] * len(engine.chooser.trees)
    name = args.served_model_name or default_model_name(model.path)
    app = create_app(engine, model.tokenizer, name, max_waiting=args.max_waiting, max_tokens_default=args.max_tokens,
                     allowed_origins=origins,
                     max_request_bytes=int(args.max_request_mb * (1 << 20)), tool_call_parser=args.tool_call_parser,
                     exclude_tools_when_none=args.exclude_tools_when_tool_choice_none)
    _log_beside_uvicorn(args.log_level)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, speculation "
          f"{args.speculation}, trees of {[t.step_size for t in engine.chooser.trees]} tokens; Ctrl-C stops it)",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_grace)
    _server_class(app.state.begin_shutdown)(config).run(sockets=[sock])
    return 0


def _log_beside_uvicorn(level: str) -> None:
    """The server's own warnings (`serve.app.log`: e.g. a request's unknown fields) printed on
    stderr as uvicorn prints its log ("WARNING:  ..."), at --log-level."""
    import logging

    from uvicorn.logging import DefaultFormatter

    log = logging.getLogger("medusa_jax.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level.upper())


def bind_port(host: str, port: int):
    """A TCP socket bound to `host`:`port`, as uvicorn binds one (SO_REUSEADDR; IPv6 for an address
    with a colon), for uvicorn to listen on once the model is loaded: `main` binds it first, so that
    a port already in use is said at once instead of after the model load.

    Raises OSError with a one-line message naming the address: in use (another server listens
    there), not allowed (a port below 1024 needs privileges) or not an address of this machine."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        if getattr(e, "errno", None) == errno.EADDRINUSE:
            raise OSError(f"cannot serve on {shown}: the port is already in use (another server?); stop it "
                          "or choose another with --port") from None
        raise OSError(f"cannot serve on {shown}: {getattr(e, 'strerror', None) or e}") from None
    sock.set_inheritable(True)
    return sock


#: Seconds before the shutdown grace runs out at which the requests still running are ended with the
#: server_shutdown error (at most half the grace): uvicorn cancels whatever is left at the deadline,
#: and a cancelled handler can answer nothing.
SHUTDOWN_MARGIN = 2.0


def _server_class(begin_shutdown):
    """uvicorn's Server class for `main`, with `begin_shutdown` (`serve.app.create_app`'s
    ``app.state.begin_shutdown``) called when a shutdown starts and as its grace runs out."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but (1) a SIGTERM or Ctrl-C that shut it down gracefully ends the process
        with status 0 (uvicorn re-raises the signal after the shutdown, which reports a kill); (2) a
        request read after the shutdown starts gets 503 (uvicorn stops listening at once, so new
        connections are refused); (3) requests still running shortly
        before the grace ends are ended by the engine, so that each gets the server_shutdown error
        (a 503 body, or an SSE error event and [DONE]) instead of being cut off by uvicorn."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            begin_shutdown()
            grace = self.config.timeout_graceful_shutdown
            timer = None
            if grace is not None:
                timer = asyncio.get_running_loop().call_later(max(grace - min(SHUTDOWN_MARGIN, grace / 2), 0.0),
                                                              begin_shutdown, True)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return Server


def parse_origins(text: str) -> List[str]:
    """--allowed-origins as a list: comma-separated, or a JSON list (vLLM's form); a trailing "/"
    dropped (a browser's Origin header has none). Raises ValueError for a JSON list of non-strings."""
    import json

    text = text.strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError("a JSON list must hold origin strings")
    else:
        items = text.split(",")
    return [o.strip().rstrip("/") or o.strip() for o in items if o.strip()]


if __name__ == "__main__":
    sys.exit(main())
