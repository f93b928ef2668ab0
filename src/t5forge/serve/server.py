"""`t5forge serve MODEL_OR_RUN_DIR`: load the model once, bind the port, serve until SIGTERM or SIGINT.

The socket is bound before the model loads, so a port in use is one line at once. On SIGTERM the server
stops accepting connections, answers the requests in flight (the engine finishes their rows), then exits 0
(uvicorn's graceful shutdown; the engine refuses new jobs from the first signal).

With `--tp N` under torchrun (`torchrun --nproc-per-node N -m t5forge serve MODEL --tp N`), every rank loads
its shards of the HF model; rank 0 serves HTTP and runs the engine, and sends each batch to the other ranks
(one broadcast of its token ids and settings), which run the same `generate`, so that the sharded layers'
collectives meet. Stop it with SIGTERM to the launcher (torchrun passes it on) or to rank 0."""

from __future__ import annotations

import contextlib
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


class Broadcaster:
    """Rank 0's messages to the other ranks (pickled objects: these are the job's own processes) over a gloo
    group of their own, whose timeout outlasts any idle time of the server (the job's default group times out
    after parallel.timeout_minutes; a follower waits for the next request as long as the server runs)."""

    def __init__(self):
        from datetime import timedelta

        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo", timeout=timedelta(days=365))

    def __call__(self, message: object = None) -> object:
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def serve_command(source: str, *, host: str = "127.0.0.1", port: int = 8000, tokenizer: str | None = None,
                  max_batch_size: int = 32, max_wait_ms: float = 10.0, max_queue: int = 256,
                  max_input_tokens: int = 512, max_new_tokens: int = 512, max_beams: int = 8,
                  dtype: str = "fp32", compile: bool = False, tp: int = 1, api_key: str | None = None,
                  log_level: str = "warning") -> None:
    """`t5forge serve` (see the module's docstring); `max_new_tokens`: the cap of a request's max_new_tokens
    (--max-new-tokens-cap)."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "prometheus_client", "httpx")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"t5forge serve needs {', '.join(missing)}: pip install 't5forge[serve]'")
    import torch

    from t5forge.inference import load_for_generation, prepare_for_inference, sharded_for_generation
    from t5forge.serve.app import Limits
    from t5forge.serve.engine import Engine, follow

    for name, value in (("--max-batch-size", max_batch_size), ("--max-queue", max_queue),
                        ("--max-input-tokens", max_input_tokens), ("--max-new-tokens-cap", max_new_tokens),
                        ("--max-beams", max_beams), ("--tp", tp)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if max_wait_ms < 0:
        raise ConfigError(f"--max-wait-ms must be >= 0, got {max_wait_ms}")
    if tp > 1 and (compile or dtype == "int8"):
        raise ConfigError("serve --tp decodes with generate's own cache in fp32, bf16 or fp16: drop --compile and "
                          "--dtype int8")
    limits = Limits(max_input_tokens, max_new_tokens, max_beams, max_inputs=max_batch_size)
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    rank0 = tp == 1 or int(os.environ.get("RANK", "0")) == 0
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(contextlib.closing(bind(host, port))) if rank0 else None
        if tp > 1:
            model, tok = stack.enter_context(sharded_for_generation(source, tokenizer, tp))
            model = prepare_for_inference(model, dtype)
            broadcast = Broadcaster()
            if not rank0:
                # Signals are rank 0's to act on (torchrun passes them to every rank): a follower ends when rank
                # 0 says so, after the requests in flight, or with the job.
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                follow(model, tok.pad_id, broadcast)
                return
            engine = Engine(model, tok, max_batch_size, max_wait_ms, max_queue, broadcast=broadcast)
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model, tok = load_for_generation(source, tokenizer, device)
            model = prepare_for_inference(model, dtype, compile)
            engine = Engine(model, tok, max_batch_size, max_wait_ms, max_queue, compile)
        description = (f"{dtype}{', compiled' if compile else ''}{f', tp {tp}' if tp > 1 else ''}, max batch "
                       f"{max_batch_size}, max wait {max_wait_ms:g} ms{', API key required' if api_key else ''}")
        _run_server(engine.start(), sock, limits, api_key, os.path.basename(os.path.normpath(source)),
                    f"serving {source} on http://{host}:{sock.getsockname()[1]} ({description})", log_level)


def _run_server(engine, sock: socket.socket, limits, api_key: str | None, model_name: str, banner: str,
                log_level: str) -> None:
    import uvicorn

    from t5forge.serve.app import build_app

    app = build_app(engine, limits, api_key, model_name)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # the first signal: refuse new jobs, answer those in flight
            engine.accepting = False
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False))
    print(banner, file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it stopped on to the handler found before it ran: for SIGTERM, one that
    # returns, so that a graceful stop ends with exit code 0 (SIGINT keeps Python's: exit 130).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.stop()
