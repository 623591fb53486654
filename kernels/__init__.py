"""Triton kernels with their torch references (shipped as `sgl_memory.kernels`).

Each kernel module holds the Triton kernel, a torch reference with the same contract, and a
launcher that picks the kernel on GPU tensors and the reference elsewhere. Tests run the kernels
under TRITON_INTERPRET=1 against the references (tests/test_kernels.py).
"""
