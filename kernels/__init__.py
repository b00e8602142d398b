"""Triton kernels of helm-zoo. Import the subpackages (e.g. :mod:`kernels.lorentz_attention`) explicitly:
this file imports nothing, so ``import kernels`` works without triton."""
