"""What the plugin knows about keras-hub models, one row per model family.

``layouts``: a tensor-parallel layout for each causal LM backbone that ships
no ``get_layout_map`` (the ``layouts`` family installs them). ``generation``:
what sharded generation reads of a causal LM (attention head counts, samplers,
``call_with_cache``'s parameters, the cache's heads axis). ``probe``: a
tiny config of a backbone with no row, for the planner to plan its layout.
Plain data and attribute reads; Keras is imported only when a layout is built.
"""
