"""Build script of gdn_packed: setuptools metadata lives in pyproject.toml; this file drives CMake to
build the optional CUDA extension `gdn_packed._C` from csrc/ (pybind11, static cudart, no libtorch).

Environment knobs:
  GDN_PACKED_NO_CUDA=1          skip the extension (the package installs without `_C`)
  GDN_PACKED_CUDA_ARCHS="80;90a" CMAKE_CUDA_ARCHITECTURES (default "80;90a")
  GDN_PACKED_CUDA_OPTIONAL=1    a failed CUDA build only warns instead of failing the install
  GDN_PACKED_CUTLASS_INCLUDE=D  the CUTLASS / CuTe headers (default: those of the `nvidia-cutlass` wheel,
                                a pinned build requirement); without them, or without 90a among the
                                archs, the sm_90a chunked kernel is left out of _C (it says why)
  GDN_PACKED_SM90_WATCHDOG=N    debug build: every mbarrier wait of the sm_90a chunked kernels prints who
                                waits on what and traps after N failed try_waits (-DGDN_SM90_WATCHDOG=N;
                                csrc/chunk_gdr_sm90_device.cuh); _C.sm90_watchdog says N (0: off)
  GDN_PACKED_SM90_PREP_ARRIVALS=1  the sm_90a forward's prep publishes its buffers by every thread's
                                mbarrier arrival instead of one elected arrival (-DGDN_SM90_PREP_ARRIVALS;
                                csrc/chunk_gdr_fwd_sm90_device.cuh), the form compute-sanitizer's racecheck
                                follows; not yet run on a GPU; _C.sm90_prep_arrivals says 128 (1: off)
  MAX_JOBS=N                    parallel compile jobs (default: number of CPUs)
  CUDACXX / CUDA_HOME           where to find nvcc (else PATH, else /usr/local/cuda/bin/nvcc)

Use `pip install -v ...` to see the CMake and nvcc command lines in the log (pip hides build output
otherwise); a copy of the last build log is kept in build/cmake/<tag>/build.log.
"""
import hashlib
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "80;90a"


def _truthy(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def find_nvcc():
    """Return (path or None, reason)."""
    if _truthy("GDN_PACKED_NO_CUDA"):
        return None, "GDN_PACKED_NO_CUDA is set"
    candidates = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c), ""
    return None, "nvcc not found (not on PATH, not at /usr/local/cuda/bin/nvcc, CUDACXX/CUDA_HOME unset)"


CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"     # pyproject.toml [build-system] requires it


def find_cutlass_include():
    """Return (directory or None, reason): the CUTLASS / CuTe C++ headers of the nvidia-cutlass wheel
    (cutlass_library/source/include), located without importing the package (its __init__ imports
    scipy, networkx, ...), or GDN_PACKED_CUTLASS_INCLUDE."""
    import importlib.util

    d = os.environ.get("GDN_PACKED_CUTLASS_INCLUDE")
    if not d:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            return None, f"the {CUTLASS_PIN} wheel (CUTLASS / CuTe headers) is not installed"
        d = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    if not os.path.isfile(os.path.join(d, "cute", "arch", "mma_sm90_gmma.hpp")):
        return None, f"no CuTe headers (cute/arch/mma_sm90_gmma.hpp) under {d}"
    return d, ""


def sm90_watchdog():
    """GDN_PACKED_SM90_WATCHDOG as the spin count of the sm_90a kernels' barrier watchdog ('' when off)."""
    v = os.environ.get("GDN_PACKED_SM90_WATCHDOG", "").strip()
    if v in ("", "0"):
        return ""
    if not v.isdigit() or int(v) < 1000:
        raise RuntimeError(f"gdn_packed: GDN_PACKED_SM90_WATCHDOG={v!r}: a spin count >= 1000 (e.g. 2000000)")
    return str(int(v))


def sm90_prep_arrivals():
    """'1' when GDN_PACKED_SM90_PREP_ARRIVALS asks for the per-thread prep arrivals, else ''."""
    return "1" if _truthy("GDN_PACKED_SM90_PREP_ARRIVALS") else ""


def find_cmake():
    try:  # the `cmake` PyPI package (a build requirement) ships a recent CMake
        import cmake

        exe = os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
        if os.path.isfile(exe):
            return exe
    except Exception:
        pass
    return shutil.which("cmake")


def banner(msg):
    line = "=" * 78
    print(f"\n{line}\n{msg}\n{line}\n", flush=True)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        self._nvcc, _ = find_nvcc()
        super().run()

    def build_extension(self, ext):
        try:
            self._cmake_build(ext)
        except Exception as e:  # noqa: BLE001
            if not _truthy("GDN_PACKED_CUDA_OPTIONAL"):
                raise
            banner(f"gdn_packed: CUDA extension build FAILED, continuing without _C "
                   f"(GDN_PACKED_CUDA_OPTIONAL=1): {e}")

    def _cmake_build(self, ext):
        import pybind11

        cmake = find_cmake()
        if cmake is None:
            raise RuntimeError("gdn_packed: nvcc was found but cmake was not; `pip install cmake` "
                               "or set GDN_PACKED_NO_CUDA=1")
        fullpath = os.path.abspath(self.get_ext_fullpath(ext.name))
        extdir = os.path.dirname(fullpath)
        suffix = os.path.basename(fullpath)[len(ext.name.split(".")[-1]):]
        archs = os.environ.get("GDN_PACKED_CUDA_ARCHS", DEFAULT_ARCHS)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 2)
        cutlass, why_not = find_cutlass_include()
        watchdog = sm90_watchdog()
        prep_arrivals = sm90_prep_arrivals()
        if cutlass is None:
            banner(f"gdn_packed: building _C WITHOUT the sm_90a chunked kernel: {why_not}\n"
                   f"  (pip install {CUTLASS_PIN}; backend='cuda' of chunk_gated_delta_rule then says so)")
        # a persistent build dir keyed on the toolchain makes re-installs incremental
        tag = hashlib.sha1("|".join([sys.prefix, self._nvcc, cmake, archs, suffix, cutlass or ""]).encode()
                           ).hexdigest()[:10]
        build_dir = os.path.join(ROOT, "build", "cmake", tag)
        os.makedirs(build_dir, exist_ok=True)
        os.makedirs(extdir, exist_ok=True)
        configure = [
            cmake, "-S", ROOT, "-B", build_dir,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={self._nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DGDN_EXT_SUFFIX={suffix}",
            f"-DGDN_OUTPUT_DIR={extdir}",
            f"-DGDN_CUTLASS_INCLUDE={cutlass or ''}",
            f"-DGDN_NO_SM90_WHY={why_not}",
            f"-DGDN_SM90_WATCHDOG={watchdog}",     # always passed: '' clears an earlier watchdog build's
            f"-DGDN_SM90_PREP_ARRIVALS={prep_arrivals}",     # the same
        ]
        build = [cmake, "--build", build_dir, "--verbose", "-j", jobs]
        banner(f"gdn_packed: building CUDA extension {ext.name}\n  nvcc: {self._nvcc}\n"
               f"  cmake: {cmake}\n  archs: {archs}\n  output: {fullpath}"
               + (f"\n  DEBUG: sm_90a barrier watchdog, trap after {watchdog} failed try_waits "
                  "(GDN_PACKED_SM90_WATCHDOG)" if watchdog else "")
               + ("\n  sm_90a forward: every prep thread arrives (GDN_PACKED_SM90_PREP_ARRIVALS)"
                  if prep_arrivals else ""))
        log_path = os.path.join(build_dir, "build.log")
        with open(log_path, "w") as log:
            if self._run(configure, log) != 0:
                # a stale cache (moved checkout, other generator) is the usual cause: retry clean
                print("gdn_packed: CMake configure failed, retrying with a clean build dir", flush=True)
                shutil.rmtree(build_dir, ignore_errors=True)
                os.makedirs(build_dir, exist_ok=True)
                if self._run(configure, log) != 0:
                    raise RuntimeError(f"gdn_packed: CMake configure failed (log: {log_path})")
            if self._run(build, log) != 0:
                raise RuntimeError(f"gdn_packed: CUDA extension build failed (log: {log_path})")
        if not os.path.isfile(fullpath):
            raise RuntimeError(f"gdn_packed: CMake finished but {fullpath} is missing")
        banner(f"gdn_packed: built {fullpath}")

    @staticmethod
    def _run(cmd, log):
        """Run cmd, streaming its output to stdout (the pip -v / CI log) and to the log file."""
        print("+ " + " ".join(cmd), flush=True)
        log.write("+ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        sys.stdout.flush()
        return proc.wait()


NVCC, WHY_NO_NVCC = find_nvcc()
if NVCC is None:
    # no extension at all: the wheel is then pure Python (py3-none-any)
    banner(
        "gdn_packed: building WITHOUT the CUDA extension gdn_packed._C\n"
        f"  reason: {WHY_NO_NVCC}\n"
        "  the torch and triton backends are unaffected; backend='cuda' will report itself\n"
        "  unavailable (gdn_packed._cext.cuda_unavailable_reason())."
    )

setup(
    ext_modules=[CMakeExtension("gdn_packed._C")] if NVCC else [],
    cmdclass={"build_ext": CMakeBuild},
)
