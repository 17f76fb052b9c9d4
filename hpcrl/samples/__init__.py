"""The types every stage of a step shares, at the bottom of the import graph (see sample.py)."""
