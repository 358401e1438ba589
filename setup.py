"""Builds dantinox's optional C++ extension, the block matrix product and decode attention called from JAX
through XLA FFI (``dantinox/quant/csrc/block_matmul.cc`` and its .inc files, loaded by
``dantinox.quant.block_kernel`` and ``dantinox.kv.decode_kernel``); everything else is in pyproject.toml.

The extension needs a C++17 compiler and the XLA FFI headers of the installed jaxlib (``jax.ffi.include_dir()``).
A missing compiler, missing headers, a failed compile, or ``DANTINOX_SKIP_KERNEL=1`` leave the extension out
with one warning, and the install succeeds: dantinox then runs the pure-JAX path (blocks dequantized by XLA).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL = "dantinox.quant._block_matmul"
SOURCE = os.path.join("dantinox", "quant", "csrc", "block_matmul.cc")


def _warn(text: str) -> None:
    sys.stderr.write(f"dantinox: {text}; the pure-JAX path will run (no compiled block kernel)\n")


class OptionalBuildExt(build_ext):
    """build_ext that adds the jaxlib include directory and never fails the install."""

    def run(self):
        try:
            import jax.ffi

            include = jax.ffi.include_dir()
        except Exception as err:  # jax not importable in the build environment
            _warn(f"the XLA FFI headers are not available ({type(err).__name__}: {err})")
            return
        for ext in self.extensions:
            ext.include_dirs.append(include)
        try:
            super().run()
        except Exception as err:  # no compiler, or a compile error
            _warn(f"the C++ extension did not build ({type(err).__name__}: {err})")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as err:
            _warn(f"the C++ extension did not build ({type(err).__name__}: {err})")


def _extensions():
    if os.environ.get("DANTINOX_SKIP_KERNEL", "").strip().lower() in ("1", "true", "yes", "on"):
        _warn("DANTINOX_SKIP_KERNEL is set")
        return []
    flags = [] if sys.platform == "win32" else ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wno-sign-compare",
                                                "-Wno-return-type", "-Wno-attributes", "-ffp-contract=off"]
    csrc = os.path.dirname(SOURCE)
    includes = sorted(os.path.join(csrc, name) for name in os.listdir(csrc) if name.endswith(".inc"))
    return [Extension(KERNEL, [SOURCE], depends=includes, language="c++", extra_compile_args=flags,
                      optional=True)]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
