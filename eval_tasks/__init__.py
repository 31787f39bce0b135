"""lcx.eval_tasks: lm-evaluation-harness tasks shipped with lcx (installed as `lcx.eval_tasks`)."""
