"""The package version (a module of its own: importing it imports nothing else)."""

__version__ = "0.1.0"
