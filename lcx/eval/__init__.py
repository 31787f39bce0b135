"""Evaluation entry points (`lcx eval ppl`): perplexity by context length under a RoPE spec."""
