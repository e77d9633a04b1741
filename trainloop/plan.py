"""`python -m trainloop.plan`: the entry point of trainloop/tools/plan.py."""

import sys

from trainloop.tools.plan import main

if __name__ == "__main__":
    sys.exit(main())
