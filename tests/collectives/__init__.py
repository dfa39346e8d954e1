"""The collectives on gloo ranks: all-gather, reduce-scatter, all-reduce, delta all-gather, policy."""
