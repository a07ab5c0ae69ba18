"""``python -m weightfabric.tools``: the `fabric` command."""

import sys

from weightfabric.tools.cli import main

sys.exit(main())
