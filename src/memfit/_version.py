"""memfit's version (one place: the package and the CLI's ``--version`` read it)."""

__version__ = "0.1.0"
