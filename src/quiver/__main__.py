"""`python -m quiver` runs the command line."""

import sys

from quiver.cli.main import main

sys.exit(main())
