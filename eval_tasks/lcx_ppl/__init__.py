"""`lcx_ppl`: perplexity and bits per byte of held-out works, by context length."""
