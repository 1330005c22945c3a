"""Pure-torch DTensor helpers (no Keras), re-exported here: import the names from the
package, not its modules.

A plain tensor is promoted only as the full value (a Replicate DTensor); one that looks
like one rank's shard is refused (:class:`PromotionError`). Modules: ``spec`` (the
DTensorSpec cache), ``collectives`` (the one all-reduce path, polled on CPU),
``placement`` (placement checks, ``redistributed``, ``placed``, Partial reduction),
``planner`` (may a computation run on local tensors), ``local`` (``wrap_local``,
``unwrap_local``, Megatron's "f", a layer on local tensors), ``promotion``, ``gather``
(op-specific layouts), ``einsum``, ``megatron`` and ``world`` (rank and world size)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from keras_dtensor_fix.dtensor.collectives import (
    all_gather_ints,
    all_gather_last,
    all_reduce_sum,
    all_reduce_sums,
    poll_work,  # the polling wait, for tests (it reads POLL_SECONDS here)
)
from keras_dtensor_fix.dtensor.gather import (
    batch_parallel_call,
    gather_axes_splitting,
    gather_axis,
    gather_non_batch_axes,
    per_element_call,
    update_in_place_of,
    vocab_parallel_lookup,
)
from keras_dtensor_fix.dtensor.local import (
    local_region,
    reducing_gradient,
    reducing_input,
    replicate,
    unwrap_local,
    without_kept,
    wrap_local,
    zero_gradients_if_unused,
)
from keras_dtensor_fix.dtensor.placement import (
    forget_kept,
    is_replicated,
    keep,
    kept_detached,
    on_mesh,
    one_rank_replicated,
    placed,
    redistributed,
    reduce_masked,
    reduce_partial,
    same_mesh,
)
from keras_dtensor_fix.dtensor.planner import whole
from keras_dtensor_fix.dtensor.promotion import (
    PromotionError,
    describe,
    find_dtensor,
    has_plain_tensor,
    implicit_replication,
    promote_args,
    replicate_plain,
    replicate_result,
    replicated_locals,
    set_implicit_replication,
    to_placements,
)
from keras_dtensor_fix.dtensor.spec import forget_meshes

__all__ = [
    "DTensor",
    "POLL_SECONDS",
    "PromotionError",
    "all_gather_ints",
    "all_gather_last",
    "all_reduce_sum",
    "all_reduce_sums",
    "batch_parallel_call",
    "describe",
    "find_dtensor",
    "forget_meshes",
    "gather_axes_splitting",
    "gather_axis",
    "gather_non_batch_axes",
    "has_plain_tensor",
    "implicit_replication",
    "is_replicated",
    "local_region",
    "on_mesh",
    "one_rank_replicated",
    "per_element_call",
    "placed",
    "forget_kept",
    "keep",
    "kept_detached",
    "poll_work",
    "promote_args",
    "reduce_masked",
    "reduce_partial",
    "reducing_gradient",
    "reducing_input",
    "replicate",
    "replicate_plain",
    "replicate_result",
    "replicated_locals",
    "same_mesh",
    "set_implicit_replication",
    "redistributed",
    "to_placements",
    "unwrap_local",
    "update_in_place_of",
    "vocab_parallel_lookup",
    "whole",
    "wrap_local",
    "without_kept",
    "zero_gradients_if_unused",
]

#: How long the all-reduce of a CPU tensor is polled before its thread blocks
#: (seconds; 0 blocks at once). ``collectives.poll_work`` reads it here at each call,
#: so setting it on the package takes effect at once.
POLL_SECONDS = 0.05
