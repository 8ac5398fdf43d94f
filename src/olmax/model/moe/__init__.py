"""Mixture of experts: the router and its losses (router.py), the experts' grouped matmul (gmm.py), and the
MLP sublayer with its training hooks (sublayer.py)."""
