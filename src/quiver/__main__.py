"""`python -m quiver` runs the command line."""

import sys

from quiver.cli.entry import main

sys.exit(main())
