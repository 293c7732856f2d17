"""The native CPU kernels: C compiled on first use for this machine, and the Python that
describes models to it. One file per job:

  C (one translation unit per library, `decode.c` and `gemm.c`)
    threads.h          dealing out work and the barrier a parallel region's threads meet at
    formats.h          the `Matrix` a product reads, its layouts, widening each stored format
    band.h             products of a weight stored [in, out] or packed, every format
    panels.h           products of a weight stored as panels (an LM head)
    quads.h            int8 quad panels: exact integer dot products (AVX-512 VNNI)
    linear.h           `linear`, the product every block kind calls, and its split of work
    step.h             the model, the step and what every block kind shares
    kinds_dense.h      attention over the paged KV cache, the gated MLP
    kinds_hybrid.h     the plain MLP, the sigmoid-routed mixture of experts, Mamba2
    kinds_softmax_moe.h  the softmax-routed mixture of gated experts
    kinds_gated_delta.h  the Gated DeltaNet's one-token update
    decode.c           the decode step and the one-off product (`decode_step`, `matmul`)
    gemm.c             long-batch products in bf16 / int8 dot products (prefill)

  Python
    library.py         compiling and loading the libraries (`load`)
    packing.py         weight layouts: packing, quad panels, head panels
    stack.py           a model as a stack of blocks, each of a kind (what `decode.c` reads)
    structs.py         the ctypes mirrors of the C structs (a test checks their layout)
    decoder.py         `CpuDecoder` (a bound stack) and `NativeMatrix` (a bound weight)
    gemm.py            the prefill products' entry points
"""
