"""`python -m trainloop.evaluate`: the entry point of trainloop/tools/evaluate.py."""

from trainloop.tools.evaluate import main

if __name__ == "__main__":
    main()
