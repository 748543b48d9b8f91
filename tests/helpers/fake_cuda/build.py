"""Compile the fake-CUDA shim (shim.cpp) on demand and say where it is.

The shared library must be in ``LD_PRELOAD`` when the Python process starts (``import torch``
creates the CUDA hooks object once), so this module must not import torch: it finds torch's
headers and libraries from the package's location on ``sys.path``, compiles with g++ into a
cache directory keyed by the torch version and the source's hash, and reuses it.

    from tests.helpers.fake_cuda import build
    env = dict(os.environ, LD_PRELOAD=build.library_path())   # then start the process
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim.cpp")


def torch_dir() -> str:
    """The installed torch package's directory, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("fake_cuda: torch is not importable from this Python "
                           f"({sys.executable}); activate the project's .venv")
    return list(spec.submodule_search_locations)[0]


def torch_version(tdir: str) -> str:
    try:
        with open(os.path.join(tdir, "version.py")) as f:
            m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
        return m.group(1) if m else "unknown"
    except OSError:
        return "unknown"


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "moepar", "fake_cuda")
    try:
        os.makedirs(path, exist_ok=True)
        return path
    except OSError:
        path = os.path.join(tempfile.gettempdir(), "moepar-fake-cuda")
        os.makedirs(path, exist_ok=True)
        return path


def library_path() -> str:
    """Path of the compiled shim for this torch, compiling it if it is not cached."""
    tdir = torch_dir()
    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + tdir.encode() + torch_version(tdir).encode()).hexdigest()[:16]
    ver = re.sub(r"[^A-Za-z0-9.]+", "_", torch_version(tdir))
    out = os.path.join(cache_dir(), f"libmoepar_fake_cuda-{ver}-{key}.so")
    if os.path.exists(out):
        return out
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("fake_cuda: no C++ compiler (g++, or $CXX) on PATH; it compiles "
                           f"{SOURCE} against torch's headers (apt-get install g++)")
    inc, lib = os.path.join(tdir, "include"), os.path.join(tdir, "lib")
    missing = [p for p in (os.path.join(inc, "ATen", "detail", "CUDAHooksInterface.h"),
                           os.path.join(inc, "c10", "core", "impl", "DeviceGuardImplInterface.h"))
               if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"fake_cuda: torch's C++ headers are missing ({', '.join(missing)}); "
                           f"this torch ({tdir}) was installed without them")
    # A unique temporary name, then an atomic rename: concurrent builders do not collide.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    abi = _cxx11_abi(lib)
    cmd = [compiler, "-std=c++20", "-O1", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-shared", "-fPIC",
           f"-I{inc}", f"-L{lib}", SOURCE, "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"fake_cuda: compiling the shim failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def _cxx11_abi(lib: str) -> int:
    """torch >= 2.7 wheels use the new C++ ABI; older manylinux ones did not. Read the
    library's symbols rather than guess (``__cxx11`` appears in new-ABI mangled names)."""
    path = os.path.join(lib, "libc10.so")
    try:
        with open(path, "rb") as f:
            return 1 if b"__cxx11" in f.read() else 0
    except OSError:
        return 1


def preload_env(env: dict | None = None) -> dict:
    """A copy of ``env`` (default: os.environ) with the shim first in LD_PRELOAD."""
    env = dict(os.environ if env is None else env)
    lib = library_path()
    rest = [p for p in env.get("LD_PRELOAD", "").split(os.pathsep if ":" in env.get("LD_PRELOAD", "") else " ")
            if p and p != lib]
    env["LD_PRELOAD"] = ":".join([lib] + rest)
    return env


if __name__ == "__main__":
    print(library_path())
