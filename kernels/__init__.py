"""moepar's Triton kernels, installed as ``moepar_kernels`` (never as bare ``kernels``).

Each op is a triad in one file: ``_op_kernel`` (@triton.jit), ``op()`` (check, allocate,
launch) and ``op_reference()`` in plain torch, which is also the path off CUDA. This
package imports torch and triton only, never moepar. Set ``TRITON_INTERPRET=1`` before
importing it to run the kernels on the CPU (tests do).
"""
if __name__ != "moepar_kernels":
    raise ImportError(f"this package must be imported as 'moepar_kernels', not {__name__!r}; "
                      f"install moepar (pip install -e .) and import moepar_kernels")
