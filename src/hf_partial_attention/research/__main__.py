"""``python -m hf_partial_attention.research ...``; see :mod:`.cli`."""

from .cli import main

raise SystemExit(main())
