"""The ``tandem`` command line: one module per subcommand."""

import os

# Weights and the KV cache on 2 MiB pages: a decode step reads every weight and every cached
# token once, and with 4 KiB pages the TLB misses on those scattered blocks cost ~5% of the
# step (bench model, bfloat16, batch 48: 40.2 -> 38.0 ms). torch reads this when it loads, so
# it is set before anything here imports torch; a user's own setting wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
