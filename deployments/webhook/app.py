"""The FastAPI app around a ``Receiver``: routes, size limits, JSON answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from deployments.webhook.flow_runs import PrefectAPI
from deployments.webhook.receiver import Receiver, ReceiverConfig
from deployments.webhook.schema import Rejected
from evalfleet.storage import json_safe


def create_app(config: ReceiverConfig, prefect: PrefectAPI | None = None) -> FastAPI:
    """The FastAPI app around a ``Receiver``."""
    receiver = Receiver(config, prefect)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        receiver.close()

    app = FastAPI(title="evalfleet webhook receiver", version="1", lifespan=lifespan)
    app.state.receiver = receiver

    def _json(status: int, body: dict[str, Any]) -> JSONResponse:
        headers = {"Retry-After": "5"} if status == 503 else None
        return JSONResponse(json_safe(body), status_code=status, headers=headers)

    @app.post("/v1/evaluations")
    async def create_evaluation(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            return _json(413, {"error": "too_large", "reason": f"body over "
                               f"{config.max_body_bytes} bytes"})
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            return _json(413, {"error": "too_large", "reason": f"body over "
                               f"{config.max_body_bytes} bytes"})
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            status, body = await run_in_threadpool(receiver.create, raw, headers,
                                                    str(request.base_url))
        except Rejected as err:
            return _json(err.status, err.body)
        return _json(status, body)

    @app.get("/v1/evaluations/{evaluation_id}")
    async def get_evaluation(evaluation_id: str, request: Request) -> JSONResponse:
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            body = await run_in_threadpool(receiver.status, evaluation_id, headers,
                                           str(request.base_url))
        except Rejected as err:
            return _json(err.status, err.body)
        return _json(200, body)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        checks = await run_in_threadpool(receiver.healthy)
        return _json(200 if all(checks.values()) else 503, {"ok": all(checks.values()), **checks})

    return app
