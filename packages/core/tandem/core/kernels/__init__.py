"""The model kernels, by device family, behind the kernel registry.

``handles.py`` lists every kernel and the implementation each family gets; ``handle.py`` is
how a layer's handle resolves one per (kernel, device, dtype). ``reference/`` holds the torch
implementations (any device; the ground truth the others are tested against), ``cpu/`` the
C++ kernels built for the host's instruction set at start-up and their Python bindings. The
types the attention kernels read (``attention_metadata``, ``linear_attention_metadata``) sit
at the top: every family reads the same ones.
"""
