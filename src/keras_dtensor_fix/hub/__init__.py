"""What the plugin knows of keras-hub: ``layouts`` (a layout per backbone
without its own), ``generation`` (what generation reads of a causal LM),
``probe`` (a tiny backbone for the planner). Plain data and attribute reads.
"""
