"""`python -m artrl ...` is the `artrl` command (`python -m artrl run program.py`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
