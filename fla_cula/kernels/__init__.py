"""CuTe DSL kernels, one module each. Importing this package registers every kernel's
specializations with fla_cula.jit (for the CI compile check and `python -m fla_cula info`)."""

from fla_cula.kernels import probe  # noqa: F401
