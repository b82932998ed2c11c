"""lockd: a lock daemon for one Linux host."""

__version__ = "0.1.0"
