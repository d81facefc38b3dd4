"""``python -m experiments ...``; see :mod:`.cli`."""

from .cli import main

raise SystemExit(main())
