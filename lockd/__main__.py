"""``python -m lockd`` runs the CLI, as the ``lockd`` console script does."""

from lockd.cli.fast import main

main()
