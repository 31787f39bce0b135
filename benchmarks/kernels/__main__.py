"""`python -m benchmarks.kernels ...` = `lcx bench kernels ...`."""

import sys

from benchmarks.kernels import main

sys.exit(main())
