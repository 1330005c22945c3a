"""Pure-torch DTensor helpers: find a DTensor among arguments, promote plain tensors.

Nothing here knows Keras. A plain tensor is promoted only as the *full logical
value* (a Replicate DTensor on the partner's mesh); a tensor that looks like one
rank's shard of the partner is refused with :class:`PromotionError`.

Modules, by job (each imports only those above it; collectives reads its
setting from the package):

- :mod:`.spec`: the DTensorSpec cache; ``forget_meshes`` empties it and
  torch's sharding caches when a new mesh is made.
- :mod:`.collectives`: the one all-reduce path (and generation's all-gather,
  ``all_gather_ints``), polled on CPU.
- :mod:`.placement`: mesh and placement checks, ``redistributed``, ``placed``,
  reducing Partial values.
- :mod:`.planner`: the one rule for running on local tensors: may a layer,
  an op, a loss or an optimizer update run on each rank's local tensors, and
  with which collectives on the way out (pure: placements in, a plan out;
  imported as a module, ``planner.region``; ``whole`` is also here).
- :mod:`.local`: ``wrap_local``, ``unwrap_local``, ``replicate``,
  ``reducing_gradient``, ``reducing_input``.
- :mod:`.promotion`: finding DTensors, promotion, ``PromotionError``,
  ``replicated_locals``, ``to_placements``, ``replicate_plain``.
- :mod:`.gather`: op-specific layouts (embedding lookups, index reductions,
  batch-only calls, per-element ops, slice updates, gathering outputs).
- :mod:`.region`: a layer's computation on local tensors (``local_region``).
- :mod:`.einsum`: einsum and dense layers as one local einsum per rank.
- :mod:`.megatron`: a tensor-parallel block on local tensors
  (``local_part``, ``with_split``; imported as a module).
- :mod:`.world`: this process's rank and the group's size, the one lookup
  (imported as a module: it is about processes, not tensors).

Import the names below from the package (``from keras_dtensor_fix.dtensor
import redistributed``); the modules are its layout, not its interface.

:data:`POLL_SECONDS` is a setting, and it lives here only: ``poll_work`` in
:mod:`.collectives` reads ``keras_dtensor_fix.dtensor.POLL_SECONDS`` at each
call, so ``keras_dtensor_fix.dtensor.POLL_SECONDS = 0`` takes effect at once.
"""

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
from keras_dtensor_fix.dtensor.region import local_region
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
#: (seconds; 0 blocks at once). Read from here at each call (see above).
POLL_SECONDS = 0.05
