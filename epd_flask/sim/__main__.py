"""``python -m epd_flask.sim``: the same as the ``epd-flask-sim`` console script."""

import sys

from .cli import main

sys.exit(main())
