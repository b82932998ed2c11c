"""``python -m lockd`` runs the CLI."""

from lockd.cli import main

main()
