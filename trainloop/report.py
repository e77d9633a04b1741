"""`python -m trainloop.report`: the entry point of trainloop/tools/report.py."""

from trainloop.tools.report import main

if __name__ == "__main__":
    main()
