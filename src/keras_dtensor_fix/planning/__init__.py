"""A tensor-parallel layout planned from a Keras model's structure.

See docs/planner.md.
"""
