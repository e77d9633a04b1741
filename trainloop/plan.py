"""`python -m trainloop.plan`: the entry point of trainloop/tools/plan.py, and with --suggest of
trainloop/tools/suggest.py (which adds its flags to the planner's)."""

import sys

from trainloop.tools.suggest import main

if __name__ == "__main__":
    sys.exit(main())
