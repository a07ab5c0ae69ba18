import sys

from weightfabric.tools.cli import main

sys.exit(main())
