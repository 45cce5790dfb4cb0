"""Quiver's version, recorded as the producer in every file it writes."""

__version__ = "0.2.0"
