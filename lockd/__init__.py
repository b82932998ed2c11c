"""lockd: a lock daemon for one Linux host."""

from lockd import native

__version__ = "0.1.0"

# Before any module of the hot path is imported: route them to their sources
# when their compiled build must not run (see lockd.native).
native.install()
