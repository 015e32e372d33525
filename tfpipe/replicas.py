"""The data-parallel level: which replica a step runs in, and sums over replicas.

Each of R replicas runs the step on 1/R of the global batch and the optimizer
sums their gradients, so each replica's loss must be its *share* of the
global batch's loss; the step asks here for the global quantities (divisors,
rows). With R = 1 every function is the identity and adds nothing to the graph.
"""

import tensorflow as tf


def num_replicas():
    """R of the strategy in scope (1 outside any strategy)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def replica_index():
    """The index, among this process's replicas, of the replica being traced
    (a Python int; 0 outside `strategy.run`)."""
    context = tf.distribute.get_replica_context()
    if context is None or num_replicas() == 1:
        return 0
    in_sync = int(tf.get_static_value(context.replica_id_in_sync_group))
    # Replica ids run over the workers, each worker's local replicas in turn.
    return in_sync % len(tf.distribute.get_strategy().extended.worker_devices)


def sum_over_replicas(value):
    """`value` summed over the replicas (float32 scalar tensor or nest);
    `value` itself when R = 1. Called in replica context by every replica."""
    if num_replicas() == 1:
        return value
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError("tfpipe bug: a sum over replicas outside strategy.run.")
    return context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def across_replicas(fn):
    """`fn()` evaluated once in cross-replica context, where reading Keras'
    metric variables (synchronised on read) sums them over every replica;
    its result is returned to each replica. `fn()` itself when R = 1."""
    if num_replicas() == 1:
        return fn()
    return tf.distribute.get_replica_context().merge_call(lambda _: fn())
