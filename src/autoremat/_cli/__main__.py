"""``python -m autoremat._cli``: the ``autoremat`` command without its console script."""

from autoremat._cli import main

raise SystemExit(main())
