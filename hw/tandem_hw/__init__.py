"""Tandem on real hardware.

Device runtimes over torch_npu and torch.cuda, and the HCCL / NCCL communicator libraries
bound through ctypes, plugged into ``tandem.device`` and ``tandem.collectives`` by name
(entry points), so the engine never imports this package directly.
"""
