"""``python -m lockd`` runs the CLI."""

from .cli import main

main()
