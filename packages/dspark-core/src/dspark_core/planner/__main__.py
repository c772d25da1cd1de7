"""``python -m dspark_core.planner``: print a draft's plan (``plan.main``)."""

import sys

from dspark_core.planner.cli import main

sys.exit(main())
