"""`python -m specprefetch ...` is the same as the `specprefetch` command."""

import sys

from specprefetch.cli import main

sys.exit(main())
