"""GET /v1/models, /v1/models/{id}, GET and HEAD /health, and /stats."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from ..context import ServerContext, ctx
from ..openapi import errors
from ..protocol import APIError, Health, ModelCard, ModelList

router = APIRouter()


def _card(c: ServerContext) -> ModelCard:
    return ModelCard(id=c.model_name, created=int(time.time()), max_model_len=c.engine.max_model_len,
                     lcx_max_model_len_source=c.max_model_len_source, lcx_methods=c.engine.methods_info())


@router.get("/v1/models", responses=errors(401))
async def models(c: ServerContext = Depends(ctx)) -> ModelList:
    return ModelList(data=[_card(c)])


@router.get("/v1/models/{model_id:path}", responses=errors(401, 404))
async def model(model_id: str, c: ServerContext = Depends(ctx)) -> ModelCard:
    """The served model (the `openai` client's `models.retrieve`); 404 for any other name."""
    if model_id != c.model_name:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {c.model_name!r}",
                       param="model", code="model_not_found")
    return _card(c)


_HEALTH_DOC = {503: {"model": Health, "description": "the engine is not running, restarting or not responding "
                                                    "(its process's heartbeat stopped)"}}


@router.get("/health", responses=_HEALTH_DOC)
async def health(c: ServerContext = Depends(ctx)) -> Health:
    problem = c.jobs.engine_problem()
    if problem is not None:
        return JSONResponse({"status": problem}, status_code=503)
    return Health(status="ok")


@router.head("/health", response_class=Response,
             responses={200: {"description": "the engine is running and responding (no body)"},
                        503: {"description": "the engine is not running, restarting or not responding (no body)"}})
async def health_head(c: ServerContext = Depends(ctx)) -> Response:
    return Response(status_code=200 if c.jobs.engine_problem() is None else 503)


@router.get("/stats", responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                                       "description": "scheduler, engine, HTTP and event-loop pacer counters"},
                                 **errors(401)})
async def stats(c: ServerContext = Depends(ctx)) -> JSONResponse:
    return JSONResponse(dict(c.sched.snapshot(), http=c.stats.to_dict(), loop_pacer=c.pacer.to_dict(),
                             tidied_after_bursts=c.tidied, prompts=dict(c.checks.prompt_stats)))
