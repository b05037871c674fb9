"""`python -m fairshare.cli ARGS...`: the `fairshare` console script without the installed wrapper."""

import sys

from fairshare.cli.main import main

sys.exit(main())
