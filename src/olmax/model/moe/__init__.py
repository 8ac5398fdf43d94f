"""Mixture of experts: the router and its losses (router.py), the experts' SwiGLU over the rows routed to them
(experts.py) as XLA's block loop (block_loop.py) or the GPU's grouped kernels (kernels/, checked before a run by
selfcheck.py), and the MLP sublayer with its training hooks (sublayer.py)."""
