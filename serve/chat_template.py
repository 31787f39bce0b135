"""The chat template the server renders `messages` with.

A tokenizer's own `chat_template` wins. A tokenizer without one (lcx's bundled models, most
base models) gets `DEFAULT_CHAT_TEMPLATE` so that /v1/chat/completions works out of the box:
one `role: content` line per message, then `assistant:` when a generation prompt is asked for
(no special tokens: the text a completion of the same transcript would get). `lcx serve --chat-template` replaces either (a file or the template itself,
as vLLM's flag), or `none` keeps the tokenizer's only (chat then answers 400 without one).

    system: You are terse.
    user: What is 2+2?
    assistant:
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
AUTO, NONE = "auto", "none"  # --chat-template keywords


def resolve_chat_template(tok: Any, spec: str | None) -> tuple[str | None, str]:
    """(template, where it comes from) for tokenizer `tok` and the server's `spec`: "auto" (or
    `DEFAULT_CHAT_TEMPLATE`): the tokenizer's, else the default; "none" or None: the tokenizer's,
    else no template; anything else: that template."""
    own = getattr(tok, "chat_template", None) or None
    if not isinstance(own, (str, type(None))):  # a dict of named templates: the default one
        own = own.get("default")
    if spec in (AUTO, DEFAULT_CHAT_TEMPLATE):
        return (own, "tokenizer") if own else (DEFAULT_CHAT_TEMPLATE, "lcx default")
    if spec in (NONE, None):
        return (own, "tokenizer") if own else (None, "none")
    return spec, "--chat-template"


def read_chat_template(arg: str) -> str:
    """`--chat-template ARG`: a keyword (auto, none), a file, or the template itself."""
    if arg in (AUTO, NONE):
        return arg
    p = Path(arg)
    if "{" not in arg and p.is_file():
        return p.read_text()
    if "{" not in arg:
        raise ValueError(f"--chat-template {arg!r}: not a file, and not a Jinja template (no '{{')")
    return arg
