"""moepar's Triton kernels, installed as ``moepar_kernels`` (never as bare ``kernels``).

Each op is a triad in one file: ``_op_kernel`` (@triton.jit), ``op()`` (check, allocate,
launch) and ``op_reference()`` in plain torch, which is also the path off CUDA. This
package imports torch and triton only, never moepar. Set ``TRITON_INTERPRET=1`` before
importing it to run the kernels on the CPU (tests do).

Why the guard below: the folder is ``kernels/`` in the repository, and ``kernels`` is also
a PyPI package (Hugging Face's kernel hub; transformers imports it when it is installed).
With the repository root on ``sys.path`` (pytest, a script run from the root) the bare name
finds this folder first. Imported under that name, this module loads the PyPI package in its
own place when one is installed, so ``import kernels`` means what its caller meant, and
refuses otherwise.
"""
if __name__ != "moepar_kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None:
        raise ImportError(f"this package must be imported as 'moepar_kernels', not {__name__!r}; "
                          f"install moepar (pip install -e .) and import moepar_kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _module   # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
