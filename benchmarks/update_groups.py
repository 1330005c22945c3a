"""Blocks mode's update per block on one process: what each group's call costs.

A functional model of ``--blocks`` blocks of six ``Dense(128)`` layers between
two more (Adam, about a hundred variables), updated step after step the way
blocks mode updates it (``compiled/update_groups.Grouped``: one compiled call
per block's variables, one for the rest) and by the class's own
``_parallel_update_step`` on all variables at once, eagerly. Prints the ms a
step of each, three rounds of ``--steps`` steps. No processes, no mesh: the
per-call cost of the groups (the signature ``Steady`` checks, the stand-ins,
dynamo's and AOT autograd's wrappers) against their kernels.

    python benchmarks/update_groups.py [--blocks 8] [--steps 50]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    import keras
    import torch
    from keras import layers

    import keras_dtensor_fix  # noqa: F401  (the families, as a user's import)
    from keras_dtensor_fix.compiled import update_groups

    torch.set_num_threads(1)

    class Block(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = [layers.Dense(128) for _ in range(6)]

        def call(self, x):
            for dense in self.dense:
                x = dense(x)
            return x

    keras.utils.set_random_seed(0)
    inputs = keras.Input((128,))
    blocks = [Block(name=f"block_{i}") for i in range(args.blocks)]
    x = layers.Dense(128, name="embed")(inputs)
    for block in blocks:
        x = block(x)
    model = keras.Model(inputs, layers.Dense(3, name="head")(x))
    variables = model.trainable_variables
    grads = [torch.randn(v.shape) for v in variables]
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(variables)
    bound = functools.partial(update_groups._update_function(optimizer), optimizer)
    grouped = update_groups.Grouped(optimizer, blocks)
    lr = optimizer._get_current_learning_rate()

    def steps(count: int, by_group: bool) -> float:
        began = time.perf_counter()
        for _ in range(count):
            with torch.no_grad():
                if by_group:
                    grouped(bound, optimizer, grads, variables, lr)
                else:
                    bound(grads, variables, lr)
        return (time.perf_counter() - began) / count * 1e3

    steps(5, True)  # compile and settle
    steps(5, False)
    groups = len(grouped._groups(variables))
    print(f"{len(variables)} variables, {groups} groups")
    for _ in range(3):
        print(
            f"per group, compiled {steps(args.steps, True):.2f} ms a step; "
            f"all at once, eager {steps(args.steps, False):.2f} ms"
        )


if __name__ == "__main__":
    main()
