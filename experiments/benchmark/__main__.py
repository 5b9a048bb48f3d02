"""``python -m experiments.benchmark``: see :mod:`experiments.benchmark.suite`."""

from experiments.benchmark.suite import main

raise SystemExit(main())
