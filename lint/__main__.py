"""Entry point for ``python -m trainlint``."""

import sys

from trainlint.cli import main

sys.exit(main())
