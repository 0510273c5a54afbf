"""Data parallelism for the integrators: replicas kept identical by a decision broadcast
(:mod:`._replicas`), sharded optimizer state (:mod:`._shard`, :mod:`._dp`) and FSDP2 support
(:mod:`._fsdp`)."""
