"""torch_npu's fused ops as the model kernels on Ascend NPUs, where vllm-ascend uses them: the
KV cache write, paged decode attention, prefill attention over the paged cache, RMSNorm and
add-RMSNorm, rotary, SwiGLU and the MoE routing and grouped matmuls. Each wraps one op (or a
few) behind the kernel's own signature, called with the arguments, layouts and dtypes
torch_npu's documentation gives; where an op does not take the dtype (the attention ops and
the cache write serve float16 and bfloat16 only) the kernel is not offered and the Triton
kernel or the torch reference serves instead. ``loading.py`` says whether torch_npu imports.
On CPU the simulator's stand-in (``tandem_sim/torch_npu_standin``) takes torch_npu's place.
"""
