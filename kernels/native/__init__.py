"""Small C kernels for the CPU decode step, built on first use with the machine's C compiler.

A decode step at the sizes hcw runs on a CPU is mostly dispatch: each torch op costs ~1-2 us
whatever its size, and a Gated DeltaNet layer between its two projections is ~50 of them. The C
here does that stretch in one call (through ctypes; no torch headers, so a build takes well under a
second); `paged_decode` attends through a block table where the torch path gathers the blocks
first; `decay_scan` is the one prefill kernel, a cached request's GDN decay statistics as a plain
scan. Each kernel's reference is the torch path it replaces, which stays the path wherever the
kernel does not apply (CUDA, other dtypes, kernels "reference") and which the tests compare it
with. The choice is kernels/dispatch.py's `native` (EngineConfig.native; the CLI maps HCW_NATIVE):

    auto   build and use the kernels when a C compiler is there; without one, the torch path (the
           reason is logged once)
    0      never build or use them
    1      require them: a failed build raises NativeUnavailable

Builds go to `$HCW_NATIVE_CACHE`, else `$XDG_CACHE_HOME/hcw/native`, else `~/.cache/hcw/native`,
named by a digest of the source, the compiler, its flags and the processor's feature flags (the
code is built for this processor: `-march=native`); a build is written beside its final name and
renamed into place, so processes that build at once do not read each other's half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels.dispatch import NATIVE_MODES as MODES
from kernels.dispatch import mode as kernels_mode
from kernels.dispatch import native_mode as mode

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno")
# a kernel's flags besides FLAGS: gemv and gemv_q8 split their rows, paged_decode its (sequence,
# key-value head) pairs, gdn_decode a large state's value heads and quantise_q8 (an int8 load's)
# its rows over OpenMP threads, in the runtime torch has already loaded (libgomp.so.1), so they
# are torch's own pool
KERNEL_FLAGS = {"gemv": ("-fopenmp",), "gemv_q8": ("-fopenmp",), "paged_decode": ("-fopenmp",),
                "gdn_decode": ("-fopenmp",), "quantise_q8": ("-fopenmp",)}
# the argument types the launchers declare their C functions with
P, I, F, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_functions: dict[tuple[str, str], ctypes._CFuncPtr] = {}


class NativeUnavailable(RuntimeError):
    """native "1" (HCW_NATIVE=1) and a kernel could not be built or loaded."""


def library(name: str) -> ctypes.CDLL | None:
    """The built `kernels/native/<name>.c`, or None where it cannot be used (native "0", no
    compiler, a failed build); the outcome is kept for the process."""
    if mode() == "0":
        return None
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build_and_load(name)
        lib = _loaded[name]
    if lib is None and mode() == "1":
        raise NativeUnavailable(f"native kernel {name!r} is unavailable (see the log above); native '1' (HCW_NATIVE=1) requires it")
    return lib


def function(name: str, symbol: str, argtypes: list, restype=None) -> ctypes._CFuncPtr | None:
    """`symbol` of the built `<name>.c` with its argument and result types set, or None as `library`."""
    key = (name, symbol)
    fn = _functions.get(key)
    if fn is None:
        lib = library(name)
        if lib is None:
            return None
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = argtypes, restype
        _functions[key] = fn
    elif mode() == "0":
        return None
    return fn


def enabled() -> bool:
    """What every kernel's `applies` asks besides its shapes: outside autograd (no kernel has a
    backward) and HCW_KERNELS unset or `auto` (`reference` forces the torch path)."""
    return not torch.is_grad_enabled() and kernels_mode() == "auto"


def check_float32(what: str, *tensors: torch.Tensor) -> None:
    """Parameters a kernel reads as contiguous float32 arrays, or a ValueError naming `what`."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_contiguous():
            raise ValueError(f"{what} parameters must be contiguous float32")


def cache_dir() -> Path:
    if os.environ.get("HCW_NATIVE_CACHE"):
        return Path(os.environ["HCW_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hcw" / "native"


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): the %s kernel runs on the torch path", name)
        return None
    try:
        target = cache_dir() / f"{name}-{_digest(source, compiler)}.so"
    except OSError as err:  # the source is not installed
        log.warning("the %s kernel's source cannot be read, it runs on the torch path: %s", name, err)
        return None
    for attempt in range(2):
        if not target.exists():
            try:
                _compile(source, compiler, target)
            except (OSError, subprocess.SubprocessError) as err:
                log.warning("building the %s kernel failed, it runs on the torch path: %s", name, err)
                return None
        try:
            # PyDLL: the call keeps the GIL. These kernels run for microseconds; releasing and
            # retaking the GIL around each (CDLL) hands it to any other thread that waits for it,
            # such as `hcw chat`'s engine process's pipe threads, and the decode then waits in turn
            return ctypes.PyDLL(str(target))
        except OSError as err:
            if attempt == 0:  # a damaged build in the cache: built again once
                log.warning("loading %s failed (%s); building it again", target, err)
                target.unlink(missing_ok=True)
                continue
            log.warning("loading the %s kernel (%s) failed, it runs on the torch path: %s", name, target, err)
    return None


def _compile(source: Path, compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".part")
    os.close(fd)
    try:
        done = subprocess.run([*shlex.split(compiler), *FLAGS, *KERNEL_FLAGS.get(source.stem, ()), str(source), "-o", partial, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise subprocess.SubprocessError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
        log.info("built %s", target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _digest(source: Path, compiler: str) -> str:
    h = hashlib.sha256(source.read_bytes())
    h.update(compiler.encode())
    h.update(" ".join((*FLAGS, *KERNEL_FLAGS.get(source.stem, ()))).encode())
    h.update(_processor().encode())
    return h.hexdigest()[:16]


def _processor() -> str:
    """The processor's model and feature flags (what -march=native builds for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))
