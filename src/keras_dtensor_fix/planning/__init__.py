"""A tensor-parallel layout planned from a Keras model's structure.

``auto``: ``auto_layout_map``, its steps in order, and the plan it keeps.
``trace``: the model built on ``meta`` and run once, Keras's state put back.
``dataflow``: which weight feeds which, from that forward (pure torch).
``choose``: Megatron's column/row pairing, heads, tables, the batch axis.
``cost``: bytes per rank and collectives per step of any layout.
``layout_map``: the plan as readable ``re.fullmatch`` rules.
``cli``: ``python -m keras_dtensor_fix plan``'s table. See docs/planner.md.
"""
