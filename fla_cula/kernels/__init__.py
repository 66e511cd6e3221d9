"""CuTe DSL kernels, one module each. Importing this package imports every kernel module, which
registers its specializations with fla_cula.jit (for the CI compile check and `python -m fla_cula info`)."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
