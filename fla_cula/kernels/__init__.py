"""Kernels, one module each (CuTe DSL, or a host wrapper of a CUDA C++ kernel in fla_cula._C).

Importing this package imports no kernel: ``fla_cula.kernels.registry`` lists them and imports a
module on first use, so a module that fails to import disables only its own ops.
"""
