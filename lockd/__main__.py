"""``python -m lockd`` runs the CLI, as the ``lockd`` console script does."""

import gc

gc.disable()  # while the command loads, as bin/lockd: main() turns it back on

from lockd.cli.fast import main  # noqa: E402

main()
