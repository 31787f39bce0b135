"""GET /tokenizer_info, POST /tokenize, POST /detokenize: vLLM's shapes, which lm-eval's
`tokenizer_backend=remote` uses."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..context import ServerContext, ctx
from ..openapi import errors, post_doc
from ..protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    bad_request,
)

router = APIRouter()


@router.get("/tokenizer_info", responses=errors(401))
async def tokenizer_info(c: ServerContext = Depends(ctx)) -> TokenizerInfo:
    tok = c.tok
    return TokenizerInfo(tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, bos_token=tok.bos_token,
                         pad_token=tok.pad_token, chat_template=c.render.chat_template,
                         model_max_length=c.engine.max_model_len, vocab_size=c.engine.vocab_size)


def tokenize_ids(c: ServerContext, req: TokenizeRequest) -> list[int]:
    c.checks.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        c.checks.check_chars(req.prompt, "prompt", "the prompt")
        return c.engine.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return c.render.chat(req.messages, req.add_generation_prompt, None)


@router.post("/tokenize", response_model=TokenizeResponse, **post_doc(TokenizeRequest))
async def tokenize(request: Request, c: ServerContext = Depends(ctx)):
    req: TokenizeRequest = await c.body.parse(TokenizeRequest, request)
    ids = await c.cpu(tokenize_ids, c, req)
    return await c.json_response(TokenizeResponse(tokens=ids, count=len(ids), max_model_len=c.engine.max_model_len))


def detokenize_text(c: ServerContext, req: DetokenizeRequest) -> str:
    c.checks.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < c.engine.vocab_size]
    if bad:
        raise bad_request(f"tokens must be token ids in [0, {c.engine.vocab_size}); got {bad[:5]}", "tokens")
    return c.tok.decode(req.tokens, skip_special_tokens=False)


@router.post("/detokenize", response_model=DetokenizeResponse, **post_doc(DetokenizeRequest))
async def detokenize(request: Request, c: ServerContext = Depends(ctx)):
    req: DetokenizeRequest = await c.body.parse(DetokenizeRequest, request)
    return await c.json_response(DetokenizeResponse(prompt=await c.cpu(detokenize_text, c, req)))
