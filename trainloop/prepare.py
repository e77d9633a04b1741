"""`python -m trainloop.prepare`: the entry point of trainloop/tools/prepare.py."""

import sys

from trainloop.tools.prepare import main

if __name__ == "__main__":
    sys.exit(main())
