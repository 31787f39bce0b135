"""The API's routes, one router per concern; `lcx.serve.app.create_app` includes them all."""

from .admin import router as admin
from .chat import router as chat
from .completions import router as completions
from .tokenizer import router as tokenizer

ROUTERS = (completions, chat, tokenizer, admin)

__all__ = ["ROUTERS"]
