"""``python -m benchmarks`` == ``python -m benchmarks.run``."""

import sys

from benchmarks.run import main

sys.exit(main())
