"""What the plugin checks of a user's setup, to say clearly what is wrong
where Keras would hang or silently do something else: :mod:`.feeds` (every
process feeds an epoch the same batches), :mod:`.layout_rules` (a LayoutMap
rule that matches no variable)."""
