"""`python -m lcx.eval_tasks ARGS`: lm-eval's CLI with lcx's tasks and `lcx` model, explicitly.

Same arguments as `lm_eval` (it is lm-eval's own entry point); the difference is that lcx
patches lm-eval here, by name, instead of through the start-up hook, so it also works with
`LCX_NO_LMEVAL_HOOK=1` or where the `.pth` file is not installed:

    python -m lcx.eval_tasks --model lcx --model_args pretrained=tiny-5m,rope_type=yarn,factor=4 \\
        --tasks passkey,modadd_shift,lcx_ppl --limit 4
    python -m lcx.eval_tasks --print-tasks-dir     # the folder to pass as lm_eval --include_path
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--print-tasks-dir"]:
        from lcx.eval_tasks import TASKS_DIR

        print(TASKS_DIR)
        return
    from lcx import _lmeval_hook

    _lmeval_hook.apply(force=True)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
