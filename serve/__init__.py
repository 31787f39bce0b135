"""lcx.serve: the OpenAI-compatible server over `lcx.engine` (installed as `lcx.serve`).

- `lcx.serve.protocol`: request bodies (strict, unknown fields rejected), response bodies and
  OpenAI error objects: the wire format, as pydantic models.
- `lcx.serve.gate`: the ASGI middleware (request ids, API key, error and disconnect counting).
- `lcx.serve.context`: `ServerContext`, what every route shares (engine, scheduler, CPU pool,
  counters), made of one part per job of the request plumbing: `lcx.serve.body` (reading and
  parsing bodies with bounded work), `lcx.serve.sampling` (validation against the engine),
  `lcx.serve.render` (chat templates, logprobs), `lcx.serve.jobs` (running choices through the
  scheduler, disconnect = abort, event streams).
- `lcx.serve.routes`: one router per concern (completions, chat, tokenizer, admin).
- `lcx.serve.scheduler`: the batching scheduler (one worker thread owns the engine; continuous
  batching; a batching window when idle).
- `lcx.serve.app`: `create_app(engine, model_name=..., api_key=...)` assembles the above.
- `lcx.serve.cli`: `lcx serve` (built-in engine, or `--engine vllm`).
- `lcx.serve.vllm_plugin`: the `vllm.general_plugins` entry point that applies lcx methods inside
  vLLM (`lcx serve --engine vllm`, `vllm serve`, `lm_eval --model vllm`).

Importing this package imports nothing heavy; fastapi/uvicorn are needed only by the server
modules (the `serve` extra), vLLM only by the plugin.
"""
