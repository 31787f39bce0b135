"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template, n choices,
logprobs with top_logprobs, streamed or not."""

from __future__ import annotations

import time
import uuid
from typing import Iterator

from fastapi import APIRouter, Depends, Request

from lcx.engine import StepEvent

from ..context import ServerContext, ctx
from ..jobs import Job, usage
from ..openapi import post_doc
from ..protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    Usage,
    bad_request,
)

router = APIRouter()


def chat_jobs(c: ServerContext, req: ChatCompletionRequest) -> tuple[list[Job], int]:
    """Validate, render, tokenize; one job per choice, and the top_logprobs k. On the CPU pool."""
    req.check_unsupported()
    c.checks.check_model(req.model)
    c.checks.check_n_and_seed(req, 1)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if asked is not None and asked < 1:
        raise bad_request(f"{param} must be >= 1, got {asked}", param)
    ids = c.render.chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    max_tokens = asked if asked is not None else max(0, c.engine.max_model_len - len(ids))
    k = req.top_logprobs or 0
    rename = {"prompt": "messages", "max_tokens": param}
    jobs = [Job(ch, 0, ids, "", c.checks.sampling(req, ids, max_tokens, logprobs=k if req.logprobs else None,
                                           prompt_logprobs=None, choice=ch, rename=rename))
            for ch in range(req.n)]
    c.checks.check_work(jobs, req.n)
    c.checks.count_prompt(ids)
    return jobs, k


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             **post_doc(ChatCompletionRequest, stream=True, generates=True))
async def chat(request: Request, c: ServerContext = Depends(ctx)):
    req: ChatCompletionRequest = await c.body.parse(ChatCompletionRequest, request)
    jobs, k = await c.cpu(chat_jobs, c, req, inline=c.small_request(request))
    head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=c.model_name)

    if not req.stream:
        await c.jobs.run_all(jobs, request)

        def response() -> ChatCompletionResponse:
            return ChatCompletionResponse(**head, usage=usage(jobs), choices=[ChatChoice(
                index=j.index, message=AssistantMessage(content="".join(j.text)),
                logprobs=c.render.chat_logprobs(j.logprobs, k) if req.logprobs else None,
                finish_reason=j.finish_reason) for j in jobs])

        small = c.small_result(request, jobs)
        return await c.json_response(await c.cpu(response, inline=small), inline=small)

    def on_event(j: Job, ev: StepEvent) -> Iterator[ChatCompletionChunk]:
        if ev.text or ev.token_ids or ev.finished:
            yield ChatCompletionChunk(**head, choices=[ChatChunkChoice(
                index=j.index, delta=ChatDelta(content=ev.text or None),
                logprobs=c.render.chat_logprobs(ev.logprobs, k) if req.logprobs else None,
                finish_reason=ev.finish_reason if ev.finished else None)])

    first = [ChatCompletionChunk(**head, choices=[ChatChunkChoice(
        index=j.index, delta=ChatDelta(role="assistant", content=""))]) for j in jobs]
    want_usage = req.stream_options is not None and req.stream_options.include_usage

    def usage_chunk(u: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head, choices=[], usage=u)

    return c.jobs.sse_response(request, jobs, on_event, first=first, usage_chunk=usage_chunk if want_usage else None)
