"""lcx.serve: the OpenAI-compatible server and the vLLM plugin (installed as `lcx.serve`)."""
