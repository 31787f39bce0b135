"""lcx.serve: the OpenAI-compatible server over `lcx.engine` (installed as `lcx.serve`).

- `lcx.serve.protocol`: request bodies (strict, unknown fields rejected) and OpenAI error objects.
- `lcx.serve.scheduler`: the batching scheduler (one worker thread owns the engine; continuous
  batching; a batching window when idle).
- `lcx.serve.app`: `create_app(engine, model_name=..., api_key=...)`, the FastAPI app
  (/v1/completions, /v1/chat/completions, /v1/models, /health, /stats, /tokenizer_info,
  /tokenize, /detokenize).
- `lcx.serve.cli`: `lcx serve`.

Not here yet: the vLLM plugin (`vllm.general_plugins` entry point applying lcx methods inside
`vllm serve`), planned for a session with vLLM installed. Importing this package imports nothing
heavy; fastapi/uvicorn are needed only by `app`/`cli` (the `serve` extra).
"""
