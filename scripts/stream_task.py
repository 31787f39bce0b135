"""Same as `lcx train stream` (kept for the command quoted in results/streaming_task.json)."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from lcx.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["train", "stream", *sys.argv[1:]]))
