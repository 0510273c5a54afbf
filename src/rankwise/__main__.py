"""``python -m rankwise``: the command line (as the ``rankwise`` script)."""

from .cli import main

raise SystemExit(main())
