"""olmax: reproducible, verifiable OLMo 3 pretraining on JAX."""

from olmax.runtime import quiet_cuda_plugin

quiet_cuda_plugin()  # before anything imports jax: the CUDA plugin's start-up lines are noise without a GPU
