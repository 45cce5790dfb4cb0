"""`python -m quiver` runs the command line."""

import sys

from quiver.tools.cli import main

sys.exit(main())
