"""Every chapter's commands: ``python -m engine_lib`` runs the command line (``cli.py``)."""

from .cli import main

raise SystemExit(main())
