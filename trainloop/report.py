"""`python -m trainloop.report`: the entry point of trainloop/tools/report.py."""

import sys

from trainloop.tools.report import main

if __name__ == "__main__":
    main()
