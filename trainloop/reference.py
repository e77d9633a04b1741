"""`python -m trainloop.reference`: the entry point of trainloop/tools/reference.py."""

import sys

from trainloop.tools.reference import main

if __name__ == "__main__":
    sys.exit(main())
