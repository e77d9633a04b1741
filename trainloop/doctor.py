"""`python -m trainloop.doctor`: the entry point of trainloop/tools/doctor.py."""

import sys

from trainloop.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
