"""The Triton kernels: one source for CUDA (Triton) and Ascend (triton-ascend, as vllm-ascend
compiles its Gated DeltaNet kernels).

They keep to the subset triton-ascend compiles: masked loads and stores, ``tl.arange``
offsets, elementwise math and reductions, loops with runtime bounds. Each compiles on its
first launch on a device; the kernel registry makes that one registration per (kernel,
device, dtype) however many workers reach it together. ``loading.py`` says whether Triton can
serve at all; the suite runs every kernel under Triton's interpreter on CPU (``tox -e
triton``) against its torch reference.
"""
