"""`python -m engine.checkpoint`: see engine/checkpoint/cli.py."""

import sys

from engine.checkpoint.cli import main

sys.exit(main())
