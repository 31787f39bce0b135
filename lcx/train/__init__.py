"""Training entry points (`lcx train lm`)."""
