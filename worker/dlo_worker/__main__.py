"""``python -m dlo_worker`` is ``dlo-worker``."""

import sys

from dlo_worker.cli.main import main

sys.exit(main())
