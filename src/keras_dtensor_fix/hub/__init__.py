"""What the plugin knows about keras-hub models, one row per model family.

``layouts``: a tensor-parallel layout for each causal LM backbone that ships
no ``get_layout_map`` (the ``layouts`` family installs them). Plain data and
LayoutMap construction; Keras is imported only when a layout is built.
"""
