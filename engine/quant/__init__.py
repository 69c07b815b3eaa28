"""Weight-only quantization at load (``--quantization int8|int4``): engine/quant/linear.py.

The INT8 KV cache (``--kv-cache-dtype int8``) lives with the other KV kernels
(kernels/splitserve_kernels/kv_int8.py); the engine only allocates it (engine/model_runner.py).
"""
