"""`python -m trainloop.sweep`: the entry point of trainloop/tools/sweep.py."""

from trainloop.tools.sweep import main

if __name__ == "__main__":
    main()
