"""Op handling: ``handlers`` (the op-handler table), ``call`` (what a row receives),
``layout`` (rows that place their own results), ``values`` (the Keras-facing side of the
local/DTensor boundary), ``first_call`` (a fast path's first call checked against
DTensor's), ``shardwise`` (an optimizer's update on local shards)."""
