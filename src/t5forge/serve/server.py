"""`t5forge serve MODEL_OR_RUN_DIR`: load the model once, bind the port, serve until SIGTERM or SIGINT.

The socket is bound before the model loads, so a port in use is one line at once. On SIGTERM the server
stops accepting connections, answers the requests in flight (the engine finishes their rows), then exits 0
(uvicorn's graceful shutdown; the engine refuses new jobs from the first signal)."""

from __future__ import annotations

import os
import signal
import socket
import sys

from t5forge.errors import ConfigError

API_KEY_ENV = "T5FORGE_API_KEY"


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({error.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    return sock


def serve_command(source: str, *, host: str = "127.0.0.1", port: int = 8000, tokenizer: str | None = None,
                  max_batch_size: int = 32, max_wait_ms: float = 10.0, max_queue: int = 256,
                  max_input_tokens: int = 512, max_new_tokens: int = 512, max_beams: int = 8,
                  dtype: str = "fp32", compile: bool = False, tp: int = 1, api_key: str | None = None,
                  log_level: str = "warning") -> None:
    import torch
    import uvicorn

    from t5forge.inference import load_for_generation, prepare_for_inference
    from t5forge.serve.app import Limits, build_app
    from t5forge.serve.engine import Engine

    if tp != 1:
        raise ConfigError("serve --tp is not available yet: serve on one device (drop --tp), or run "
                          "`t5forge generate --tp N` for batch jobs")
    for name, value in (("--max-batch-size", max_batch_size), ("--max-queue", max_queue),
                        ("--max-input-tokens", max_input_tokens), ("--max-new-tokens", max_new_tokens),
                        ("--max-beams", max_beams)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if max_wait_ms < 0:
        raise ConfigError(f"--max-wait-ms must be >= 0, got {max_wait_ms}")
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    sock = bind(host, port)
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, tok = load_for_generation(source, tokenizer, device)
        model = prepare_for_inference(model, dtype, compile)
        engine = Engine(model, tok, max_batch_size, max_wait_ms, max_queue, compile).start()
        limits = Limits(max_input_tokens, max_new_tokens, max_beams, max_inputs=max_batch_size)
        app = build_app(engine, limits, api_key, model_name=os.path.basename(os.path.normpath(source)))

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # the first signal: refuse new jobs, answer those in flight
                engine.accepting = False
                super().handle_exit(sig, frame)

        server = Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))
        print(f"serving {source} on http://{host}:{sock.getsockname()[1]} ({dtype}{', compiled' if compile else ''}"
              f", max batch {max_batch_size}, max wait {max_wait_ms:g} ms{', API key required' if api_key else ''})",
              file=sys.stderr, flush=True)
        # uvicorn re-raises the signal it stopped on to the handler found before it ran: for SIGTERM, one that
        # returns, so that a graceful stop ends with exit code 0 (SIGINT keeps Python's: exit 130).
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
        engine.stop()
    finally:
        sock.close()
