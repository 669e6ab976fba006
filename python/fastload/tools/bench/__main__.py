"""``python -m fastload.tools.bench``: the benchmark (:mod:`fastload.tools.bench.run`)."""

import sys

from fastload.tools.bench.run import main

sys.exit(main())
