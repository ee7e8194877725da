"""GPU ops: thin Python wrappers that validate arguments and launch ``csrc`` kernels through the runtime.

Submodules (imported on use, so that importing the package needs no GPU):
``compress`` (tile compression, byte-identical to :func:`kvarn_cutlass.codec.encode_tiles`) and
``rotate`` (row-wise Walsh-Hadamard transform of queries and attention outputs).
"""
