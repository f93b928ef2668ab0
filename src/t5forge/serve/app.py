"""The HTTP side of `t5forge serve` (FastAPI on uvicorn): validation, limits, authentication and metrics;
decoding happens in the engine (serve/engine.py), whose worker thread answers each request's future.

- `POST /v1/generate` {"text": str | [str, ...], generation settings (names of `t5forge generate`),
  "truncate": false, "seed": null, "return_token_ids": false} -> {"texts", "generated_tokens",
  "input_tokens", "timing": {"queue_ms", "total_ms"}} (+ "token_ids"). An input over the length limit is 413
  unless "truncate"; unknown fields, bad values and settings over the server's caps are 422 naming the
  field (`settings` for settings inconsistent with each other); a full queue is 503 with Retry-After;
  during shutdown 503.
- `GET /health`: 200 {"status": "ok"} while serving, 503 while shutting down or once the engine stopped.
- `GET /metrics`: Prometheus text format.
With an API key, /v1/generate and /metrics need `Authorization: Bearer KEY` (401 otherwise)."""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from t5forge.errors import ConfigError
from t5forge.models.generate import GenerationSettings
from t5forge.serve.engine import Engine, Job, JobResult, QueueFull, ShuttingDown


@dataclass
class Limits:
    """What one request may ask for."""

    max_input_tokens: int = 512
    max_new_tokens_cap: int = 512
    max_beams: int = 8  # also the cap of num_return_sequences
    max_inputs: int = 32  # texts per request
    retry_after_s: int = 1


class GenerateRequest(BaseModel):
    """The body of POST /v1/generate: texts, then GenerationSettings' fields (defaults: transformers')."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str]
    max_new_tokens: int = Field(20, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    num_beams: int = Field(1, ge=1)
    num_return_sequences: int = Field(1, ge=1)
    do_sample: bool = False
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(50, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    no_repeat_ngram_size: int = Field(0, ge=0)
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    truncate: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    return_token_ids: bool = False

    def settings(self) -> dict:
        return self.model_dump(exclude={"text", "truncate", "seed", "return_token_ids"})


def field_error(status: int, field: str, message: str) -> JSONResponse:
    """FastAPI's own error shape: {"detail": [{"loc": ["body", field], "msg": ..., "type": ...}]}."""
    return JSONResponse({"detail": [{"loc": ["body", field], "msg": message, "type": "value_error"}]},
                        status_code=status)


def build_app(engine: Engine, limits: Limits, api_key: str | None = None, model_name: str = "t5") -> FastAPI:
    app = FastAPI(title="t5forge", docs_url=None, redoc_url=None, openapi_url=None)
    metrics, tokenizer = engine.metrics, engine.tokenizer

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                if request.url.path == "/v1/generate":
                    metrics.requests.labels("401").inc()
                return JSONResponse({"detail": "missing or wrong API key: send Authorization: Bearer KEY"},
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        response = await call_next(request)
        if request.url.path == "/v1/generate":
            metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        if not engine.accepting or not engine.thread.is_alive():
            return JSONResponse({"status": "shutting down" if engine.thread.is_alive() else "stopped"},
                                status_code=503)
        return {"status": "ok", "model": model_name, "queue_depth": engine.jobs.qsize() + len(engine.waiting)}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest):
        arrived = time.perf_counter()
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            return field_error(422, "text", "give a text or a non-empty list of texts")
        if len(texts) > limits.max_inputs:
            return field_error(413, "text", f"{len(texts)} texts in one request; the server takes at most "
                                            f"{limits.max_inputs} (--max-batch-size)")
        settings = body.settings()
        for name, cap, flag in (("max_new_tokens", limits.max_new_tokens_cap, "--max-new-tokens-cap"),
                                ("num_beams", limits.max_beams, "--max-beams"),
                                ("num_return_sequences", limits.max_beams, "--max-beams")):
            if settings[name] > cap:
                return field_error(422, name, f"{name}={settings[name]} is over this server's cap of {cap} ({flag})")
        try:
            GenerationSettings(**settings).validate()
        except ConfigError as error:
            return field_error(422, "settings", str(error))
        inputs = []
        for i, text in enumerate(texts):
            ids = tokenizer.encode(text, limits.max_input_tokens)
            if not ids:
                return field_error(422, "text", f"text {i + 1} is empty: give text to generate from")
            if len(ids) + 1 > limits.max_input_tokens:
                if not body.truncate:
                    return field_error(413, "text", f"text {i + 1} has more than {limits.max_input_tokens} tokens "
                                                    "(eos included); send \"truncate\": true to cut it there")
                ids = ids[:limits.max_input_tokens - 1]
            inputs.append(ids + [tokenizer.eos_id])
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(result: object) -> None:  # called by the engine's thread
            if not loop.is_closed():  # closed: the server was forced down, nobody waits for this answer
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

        job = Job(inputs, settings, deliver, seed=body.seed, submitted=arrived)
        try:
            engine.submit(job)
        except QueueFull:
            return JSONResponse({"detail": "the server's queue is full; retry later"}, status_code=503,
                                headers={"Retry-After": str(limits.retry_after_s)})
        except ShuttingDown:
            return JSONResponse({"detail": "the server is shutting down"}, status_code=503)
        result = await future
        if isinstance(result, BaseException):
            return JSONResponse({"detail": f"generation failed: {type(result).__name__}: {result}"},
                                status_code=500)
        metrics.latency.observe(time.perf_counter() - arrived)
        return _response(result, inputs, body.return_token_ids, tokenizer)

    return app


def _response(result: JobResult, inputs: list[list[int]], token_ids: bool, tokenizer) -> dict:
    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=False).strip()

    texts = [[text(t) for t in out] if out and isinstance(out[0], list) else text(out) for out in result.outputs]
    answer = {"texts": texts, "generated_tokens": result.generated_tokens,
              "input_tokens": [len(ids) for ids in inputs],
              "timing": {"queue_ms": round(result.queue_seconds * 1e3, 3), "total_ms": round(result.seconds * 1e3, 3)}}
    if token_ids:
        answer["token_ids"] = result.outputs
    return answer
