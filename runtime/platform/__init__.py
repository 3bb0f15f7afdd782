"""dlm.runtime's lowest floor: the platform modules import nothing from the rest of runtime."""

import warnings as _warnings

# ``python -m dlm.runtime.platform.settings`` (docs/environment.md's tables) runs a module that
# importing dlm.runtime has loaded already (blas.py reads DLM_BLAS through it): runpy's warning
# about that is harmless here.
_warnings.filterwarnings("ignore", message=r"'dlm\.runtime\.platform\.settings' found in sys\.modules",
                         category=RuntimeWarning)
