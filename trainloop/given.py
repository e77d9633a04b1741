"""The Python objects handed to trainloop.train (trainloop/api.py): reward functions, tools and
environment classes, each an attribute of this module under its own name, so that the config names
them as it names a file's function: objective.rewards=[trainloop.given:NAME]."""
