"""The execution layer's top: the Executor protocol, single-process (worker threads) and
multi-process (worker processes, shared-memory transport) executors, the multi-node follower."""
