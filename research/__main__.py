"""``python -m research ...``; see :mod:`.cli`."""

from .cli import main

raise SystemExit(main())
