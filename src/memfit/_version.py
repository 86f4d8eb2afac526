"""The version of memfit, in one place: ``pyproject.toml`` reads it from here at build time."""

__version__ = "0.1.0"
