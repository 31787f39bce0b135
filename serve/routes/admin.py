"""GET /v1/models, /health and /stats."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from ..context import ServerContext, ctx
from ..protocol import ModelCard, ModelList

router = APIRouter()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "to_dict"):
        return x.to_dict()
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


@router.get("/v1/models")
async def models(c: ServerContext = Depends(ctx)) -> ModelList:
    return ModelList(data=[ModelCard(
        id=c.model_name, created=int(time.time()), max_model_len=c.engine.max_model_len,
        lcx_methods={k: _jsonable(v) for k, v in c.engine.resolved_methods.items()})])


@router.get("/health")
async def health(c: ServerContext = Depends(ctx)):
    if not c.sched.alive:
        return JSONResponse({"status": "engine worker is not running"}, status_code=503)
    return {"status": "ok"}


@router.get("/stats")
async def stats(c: ServerContext = Depends(ctx)):
    return dict(c.sched.snapshot(), http=c.stats.to_dict())
