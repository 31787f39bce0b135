"""Benchmarks run from the CLI (`lcx bench ...`): timed on the device, written under results/.

- `lcx.bench.prefill`: one long prefill per method (`lcx.presets`) against the unpatched model.
- `lcx.bench.threads`: which torch thread count is fastest here, idle and under load.
- `lcx.bench.pie`: the PIE code-editing benchmark (`lcx.studies.code_edit`), one record per run
  with every sample (resumable, mergeable across processes).
- `lcx.bench.kernels`: every GPU kernel against its baseline, with roofline numbers, and a
  regression check against the stored baseline of the same GPU (`lcx bench kernels --check`).
"""
