"""Benchmarks: experiments on the library, beside it in the checkout, never inside it
(docs/contributing.md, "Layout"). Run from the CLI (`lcx bench <name>`: lcx.cli loads this
package from the checkout lcx comes from) or, from the checkout's root, `python -m
benchmarks.<name>`; the wheel leaves them out, and nothing in the library imports them.

Each module declares its command with `benchmarks.harness.Benchmark` (`BENCH`: name, description,
default `--out`, which of `--threads`/`--seed`/`--no-plot` it takes) and keeps only what is its own:
a frozen `Config` (the record's "config"), its cases and measurement, a table and a plot; it has
`DESCRIPTION`, `add_arguments(parser)`, `run(args)` and `main(argv)`, and writes its JSON under
results/ (relative to the working directory) through the harness's `Run`: the `benchmarks.record`
shape (config, environment, git SHA, results), written atomically after every case, the PNG beside
it. results/README.md lists every file and its command.

- `benchmarks.prefill`: one long prefill per method (`lcx.presets`) against the unpatched model.
- `benchmarks.threads`: which torch thread count is fastest here, idle and under load.
- `benchmarks.pie`: the PIE code-editing benchmark (`studies.code_edit`), one record per run
  with every sample (resumable, mergeable across processes).
- `benchmarks.kernels`: every GPU kernel against its baseline (timed by `triton.testing.do_bench`),
  with roofline numbers, and a regression check against the stored baseline of the same GPU
  (`lcx bench kernels --check`).
- `benchmarks.attention`: Λ-mask / LM-Infinite attention per `lcx.attention` backend vs dense
  causal SDPA on CPU, one subprocess per case (time and peak memory).
- `benchmarks.decode`: decoding speed per method through lcx's engine (LM-Infinite, sinks, sliding
  window, Self-Extend vs vanilla, 4k-32k), beside the memory-traffic ideal.
- `benchmarks.extrapolation`: perplexity and likelihood passkey per attention / RoPE method, tiny-5m.
- `benchmarks.swat`: the SWAT model vs the softmax model under every RoPE method, perplexity.
- `benchmarks.lmeval`: passkey and perplexity per RoPE method through the `lm_eval` CLI.
- `benchmarks.scale`: every method at GPU scale (model shapes to Llama-3-8B, 32k-128k tokens) on
  random weights through lcx's engine: prefill, decode, KV bytes, memory, against vanilla and the ideal.
- `benchmarks.serving`: `lcx serve` (and vLLM, when installed) under a fixed concurrent load.
"""
