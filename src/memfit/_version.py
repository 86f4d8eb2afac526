"""The version of memfit (a module of its own, so the CLI can print it without importing the package)."""

__version__ = "0.1.0"
