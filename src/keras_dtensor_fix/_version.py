"""The package's version (read by the build too)."""

__version__ = "0.1.0"
