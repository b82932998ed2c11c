"""Exit statuses of every ``lockd`` command (SPEC §9), in one place.

Kept free of click so ``lockd.runner`` (the logic of ``lockd run``) can use
them without the command-line layer.
"""

EXIT_OK = 0
#: The key is busy (one attempt found it held) or ``--wait`` ran out;
#: ``lockd run --conflict-exit-code N`` replaces it.
EXIT_BUSY = 1
#: Bad command line (click's own code) or ``INVALID_REQUEST`` from the daemon.
EXIT_USAGE = 2
EXIT_DENIED = 3
EXIT_RATE_LIMITED = 4
#: Daemon unreachable, stopping (``SHUTTING_DOWN``) or failing (``INTERNAL``).
EXIT_UNAVAILABLE = 5
#: Lease lost or not the holder (renew/release with a stale handle).
EXIT_LOST = 6
#: A bug in lockd itself (sysexits' EX_SOFTWARE); never expected.
EXIT_BUG = 70
#: ``lockd run``: COMMAND found but not executable (as a shell says it).
EXIT_CANNOT_EXECUTE = 126
#: ``lockd run``: no such COMMAND (as a shell says it).
EXIT_NOT_FOUND = 127
#: Interrupted by Ctrl-C (the shell's convention: 128 + SIGINT).
EXIT_INTERRUPTED = 130
