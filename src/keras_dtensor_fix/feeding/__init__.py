"""What processes feed a ModelParallel epoch (:mod:`.agreement`: the same
batches on every process, or a named error on all of them)."""
