"""``python -m dataspace.cli``: the same as the ``dataspace`` command."""

import sys

from . import main

sys.exit(main())
