"""POST /v1/completions: prompts as text or token ids, n choices each, echo + logprobs (prompt
scoring, lm-eval's loglikelihood), streamed or not."""

from __future__ import annotations

import time
import uuid
from typing import Iterator

from fastapi import APIRouter, Depends, Request

from lcx.engine import StepEvent

from ..context import ServerContext, ctx
from ..jobs import Job, usage
from ..openapi import post_doc
from ..protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage, bad_request

router = APIRouter()

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def completion_jobs(c: ServerContext, req: CompletionRequest) -> list[Job]:
    """Validate, tokenize and make one job per (prompt, choice). Runs on the CPU pool."""
    req.check_unsupported()
    c.checks.check_model(req.model)
    prompts = req.prompts()
    c.checks.check_n_and_seed(req, len(prompts))
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 generates nothing: it is allowed only with echo=true (to score the "
                          "prompt)", "max_tokens")
    jobs: list[Job] = []
    for pi, p in enumerate(prompts):
        if isinstance(p, str):
            c.checks.check_chars(p, "prompt", f"prompt {pi}" if len(prompts) > 1 else "the prompt")
            ids, text = c.engine.encode(p), p
            if not ids:
                raise bad_request(f"prompt {pi} tokenizes to no tokens", "prompt")
        else:
            ids, text = list(p), None
        remaining = c.engine.max_model_len - len(ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else \
            max(0, min(DEFAULT_COMPLETION_MAX_TOKENS, remaining))
        plp = req.logprobs if req.echo and req.logprobs is not None else None
        for ch in range(req.n):
            params = c.checks.sampling(req, ids, max_tokens, logprobs=req.logprobs, prompt_logprobs=plp, choice=ch,
                                allow_empty=req.echo)
            if text is None:
                text = c.tok.decode(ids, skip_special_tokens=False)
            jobs.append(Job(len(jobs), pi, ids, text, params))
    c.checks.check_work(jobs, req.n)
    for j in {j.prompt_index: j for j in jobs}.values():
        c.checks.count_prompt(j.prompt_ids)
    return jobs


@router.post("/v1/completions", response_model=CompletionResponse, **post_doc(CompletionRequest, stream=True, generates=True))
async def completions(request: Request, c: ServerContext = Depends(ctx)):
    req: CompletionRequest = await c.body.parse(CompletionRequest, request)
    jobs = await c.cpu(completion_jobs, c, req, inline=c.small_request(request))
    head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=c.model_name)

    def echo_part(j: Job) -> tuple[str, CompletionLogprobs | None]:
        if not req.echo:
            return "", None
        lp = None
        if req.logprobs is not None:
            lp, _ = c.render.completion_logprobs(j.prompt_ids, j.prompt_logprobs or [None] * len(j.prompt_ids), 0)
        return j.prompt_text, lp

    if not req.stream:
        await c.jobs.run_all(jobs, request)

        def response() -> CompletionResponse:
            out = []
            for j in jobs:
                etext, elp = echo_part(j)
                lp = None
                if req.logprobs is not None:
                    gen, _ = c.render.completion_logprobs(j.token_ids, j.logprobs, len(etext))
                    lp = gen if elp is None else elp + gen
                out.append(CompletionChoice(index=j.index, text=etext + "".join(j.text), logprobs=lp,
                                            finish_reason=j.finish_reason))
            return CompletionResponse(**head, choices=out, usage=usage(jobs))

        small = c.small_result(request, jobs)
        return await c.json_response(await c.cpu(response, inline=small), inline=small)

    def on_event(j: Job, ev: StepEvent) -> Iterator[CompletionResponse]:
        if not j.started:
            j.started = True
            etext, elp = echo_part(j)
            j.text_offset = len(etext)  # generated tokens' offsets continue after the echoed prompt
            if etext:
                yield CompletionResponse(**head, choices=[CompletionChoice(index=j.index, text=etext, logprobs=elp)])
        if ev.text or ev.token_ids or ev.finished:
            lp = None
            if req.logprobs is not None:
                # offsets into the choice's whole text, continuing from the previous chunks (vLLM)
                lp, j.text_offset = c.render.completion_logprobs(ev.token_ids, ev.logprobs, j.text_offset)
            yield CompletionResponse(**head, choices=[CompletionChoice(
                index=j.index, text=ev.text, logprobs=lp, finish_reason=ev.finish_reason if ev.finished else None)])

    want_usage = req.stream_options is not None and req.stream_options.include_usage

    def usage_chunk(u: Usage) -> CompletionResponse:
        return CompletionResponse(**head, choices=[], usage=u)

    return c.jobs.sse_response(request, jobs, on_event, usage_chunk=usage_chunk if want_usage else None)
