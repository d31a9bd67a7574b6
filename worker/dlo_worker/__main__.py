"""``python -m dlo_worker`` is ``dlo-worker``."""

import sys

from dlo_worker.cli import main

sys.exit(main())
