"""The package version (one copy: ``autoremat.__version__`` and reports read it)."""

__version__ = "0.1.0"
