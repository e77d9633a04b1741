"""`python -m trainloop.verify_resume`: the entry point of trainloop/tools/verify_resume.py."""

import os
import sys

from trainloop.tools.verify_resume import main

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
