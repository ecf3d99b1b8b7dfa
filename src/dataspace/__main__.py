"""``python -m dataspace``: the same as the ``dataspace`` command."""

import sys

from .cli import main

sys.exit(main())
