"""``python -m autoremat``: the ``autoremat`` command without its console script."""

from autoremat._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
