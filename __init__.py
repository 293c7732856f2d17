"""stillcut: ask questions about video on hardware you own.

The repository root is this package; `vision`, `kernels`, `engine` and `service` are its
subpackages. Heavy imports stay lazy so `import stillcut.engine` never pulls in PyAV.
"""

__version__ = "0.1.0"
