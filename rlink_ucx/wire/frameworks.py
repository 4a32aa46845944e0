"""Arrays of the training framework: the one place rlink turns its host memory into torch,
numpy, JAX or TensorFlow arrays (``RLinkDataset(format=...)``, ``ReplayDataset(format=...)``,
``Actor.get_remote_model(format=...)``), and checks that framework is installed.

An :class:`Adapter` takes a typed numpy view of rlink's staging memory (bfloat16 as its uint16
bits) and hands it over without a copy where the framework allows one:

- ``numpy``: the view itself.
- ``torch``: ``torch.from_numpy`` (a view).
- ``tensorflow``: DLPack (a view) on CPU. bfloat16 is bit-cast by TensorFlow (a copy); data
  not 64-byte aligned is copied (TensorFlow's kernels abort on it).
- ``jax``: DLPack on CPU, which XLA takes without a copy only from 64-byte aligned memory (rlink's
  staging buffers are aligned; a buffer that is not is copied by JAX). Copies: 64-bit types
  while ``jax_enable_x64`` is off (JAX makes them 32-bit), bfloat16 and bool (no DLPack path).

On any other device (a GPU) the framework copies the host array there (``jax.device_put``,
``tf.identity`` under ``tf.device``); only torch has rlink's own pinned, asynchronous CUDA path
(``store/gather.py``).

The frameworks are imported when an adapter is made, never at ``import rlink_ucx``; a missing one
is a :class:`ConfigError` naming the extra that installs it.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import mmap
import threading
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ConfigError
from .codec import DTYPES

__all__ = ["FORMATS", "Adapter", "adapter", "adapter_soon", "aligned", "default_format", "importable", "require",
           "typed"]

FORMATS = ("torch", "numpy", "jax", "tensorflow")
_EXTRAS = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow"}


def importable(name: str) -> bool:
    """True when ``name`` can be imported (found, and not blocked by an import hook)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def default_format() -> str:
    """What arrays rlink hands out when no format is named: torch where torch is installed (what
    rlink always did), numpy otherwise."""
    return "torch" if importable("torch") else "numpy"


# Held while rlink imports a framework on one of its threads: torch imported by two threads at
# once (a get_remote_model's adapter and the broadcast group's join, weights/cast_member.py)
# hands one of them a half-initialised module, and the process aborts.
IMPORT_LOCK = threading.RLock()


def require(fmt: str) -> ModuleType | None:
    """The framework module of ``fmt`` (None for numpy). ConfigError for an unknown format or a
    framework that cannot be imported, naming the extra that installs it."""
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "numpy":
        return None
    try:
        with IMPORT_LOCK:
            return importlib.import_module(fmt)
    except ImportError as exc:
        raise ConfigError(f'format={fmt!r} needs {fmt}, which cannot be imported here ({exc}): '
                          f'pip install "rlink-ucx[{_EXTRAS[fmt]}]"') from exc  # fmt: skip


def _bfloat16_numpy() -> Any:
    """ml_dtypes' bfloat16 (installed with JAX and TensorFlow), or None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


class Adapter:
    """Hands typed numpy views out as arrays of one framework on one device."""

    format = "numpy"

    def __init__(self, device: Any):
        if device not in (None, "cpu"):
            raise ConfigError(f"format='numpy' arrays live in host memory: device must be 'cpu', not {device!r}")
        self.device: Any = "cpu"
        self.host = True  # the arrays live in host memory
        self.cuda = False  # whether rlink's own pinned CUDA copy path applies (torch only)
        self._bf16 = _bfloat16_numpy()

    def array(self, view: np.ndarray, dtype: str) -> Any:
        """``view`` (a typed numpy view; bfloat16 as uint16 bits) in this framework on ``device``.
        Numpy shows bfloat16 as ml_dtypes' bfloat16 when that is installed, else as the uint16 bits."""
        if dtype == "bfloat16" and self._bf16 is not None:
            return view.view(self._bf16)
        return view


class TorchAdapter(Adapter):
    format = "torch"

    def __init__(self, device: Any):
        torch = require("torch")
        assert torch is not None
        self.torch = torch
        try:
            self.device = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"format='torch': {device!r} is not a torch device ({exc})") from exc
        self.cuda = self.device.type == "cuda"
        self.host = self.device.type == "cpu"
        if self.cuda and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device} requested but CUDA is not available")

    def array(self, view: np.ndarray, dtype: str) -> Any:
        t = self.torch.from_numpy(view)
        if dtype == "bfloat16":
            t = t.view(self.torch.bfloat16)
        return t if not self.cuda else t.to(self.device)


class JaxAdapter(Adapter):
    format = "jax"

    def __init__(self, device: Any):
        jax = require("jax")
        assert jax is not None
        self.jax = jax
        self.device = _jax_device(jax, device)
        self.cuda = False
        self.host = self.device.platform == "cpu"
        self._bf16 = _bfloat16_numpy()
        self._copied: set[str] = {"bool", "bfloat16"}  # dtypes without a DLPack path here
        self._import = _jax_dlpack_import() if self.host else None

    def array(self, view: np.ndarray, dtype: str) -> Any:
        jax = self.jax
        if dtype in self._copied or not self.host:
            host = view.view(self._bf16) if dtype == "bfloat16" else view
            return jax.device_put(host, self.device)
        if self._import is not None and (view.dtype.itemsize < 8 or jax.config.jax_enable_x64):
            try:
                return self._import(view.__dlpack__(), self.device)
            except Exception:  # noqa: BLE001 - a jaxlib whose private call changed: the public one from now on
                self._import = None
        try:
            out = jax.dlpack.from_dlpack(view)
        except (BufferError, TypeError, RuntimeError, ValueError):
            self._copied.add(dtype)
            return self.array(view, dtype)
        return out if self.device in out.devices() else jax.device_put(out, self.device)


def _jax_dlpack_import() -> Any:
    """The call ``jax.dlpack.from_dlpack`` makes for a CPU array, without the ~40 us of Python it
    spends around it on every call (device lookup, a stream query that raises on CPU, dtype
    canonicalisation, which only 64-bit types without ``jax_enable_x64`` need: those take the
    public path). Private jaxlib API, so any failure falls back to ``from_dlpack`` for good."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version  # type: ignore[attr-defined]
    except ImportError:
        return None
    kdl_cpu = 1  # DLPack's kDLCPU
    if jaxlib_extension_version >= 467:
        return lambda capsule, device: _jax.dlpack_managed_tensor_to_buffer(capsule, device, None, None, kdl_cpu)
    return lambda capsule, device: _jax.dlpack_managed_tensor_to_buffer(capsule, device, None, None)


TF_ALIGN_BYTES = 64  # Eigen's largest alignment (AVX-512)


class TensorFlowAdapter(Adapter):
    format = "tensorflow"

    def __init__(self, device: Any):
        tf = require("tensorflow")
        assert tf is not None
        self.tf = tf
        name = "/CPU:0" if device in (None, "cpu") else str(device)
        try:
            with tf.device(name):
                probe = tf.zeros(())
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"format='tensorflow': no device {name!r} here ({exc})") from exc
        self.device = probe.device
        self.cuda = False
        self.host = "CPU" in self.device.upper()
        self._copied: set[str] = set()

    def array(self, view: np.ndarray, dtype: str) -> Any:
        tf = self.tf
        if dtype in self._copied:
            with tf.device(self.device):
                return tf.identity(tf.convert_to_tensor(view if dtype != "bfloat16" else view.view(np.int16)))
        if view.size and view.ctypes.data % TF_ALIGN_BYTES:
            # TensorFlow's kernels take tensor data as aligned (Eigen) and abort the process on
            # a DLPack view that is not, e.g. a weights leaf at an odd offset: copy that one.
            out = tf.constant(view)
        else:
            try:
                out = tf.experimental.dlpack.from_dlpack(view.__dlpack__())
            except (BufferError, TypeError, RuntimeError, ValueError, tf.errors.InvalidArgumentError):
                self._copied.add(dtype)
                return self.array(view, dtype)
        if dtype == "bfloat16":  # uint16 bits -> bfloat16 (a copy: TensorFlow's bitcast)
            out = tf.bitcast(out, tf.bfloat16)
        if self.host:
            return out
        with tf.device(self.device):
            return tf.identity(out)


def typed(host: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """``host``'s bytes (a flat uint8 array) as wire dtype ``dtype`` in ``shape``, without a copy,
    in a view that keeps ``host`` itself referenced: numpy would make a plain view's base the
    array ``host`` was cut from, and the ring and the staging pools count references to ``host``
    to know whether a batch still uses it."""
    return np.frombuffer(host.data, dtype=DTYPES[dtype]).reshape(shape)


def aligned(shape: tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """An uninitialised array starting on a 64-byte boundary (XLA takes only aligned memory
    without a copy). Like ``np.empty``'s, it is the base of every view made from it (a slice of
    a larger array would leave that role to the larger one): staging pools count references to
    it to know whether a batch still uses it. Pages, so for batch-sized buffers."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    # Anonymous pages: page-aligned, and not an ndarray, so numpy keeps this array as the base.
    return np.ndarray(shape, dtype=dtype, buffer=mmap.mmap(-1, max(1, nbytes)))


def _jax_device(jax: Any, device: Any) -> Any:
    """A JAX device from a device object, ``"cpu"``, ``"gpu:0"``, ``"cuda:1"`` or ``"tpu:0"``."""
    if device is None:
        return jax.devices("cpu")[0]
    if not isinstance(device, str):
        return device
    platform, _, index = device.partition(":")
    platform = {"cuda": "gpu"}.get(platform, platform)
    try:
        return jax.devices(platform)[int(index or 0)]
    except (RuntimeError, ValueError, IndexError) as exc:
        raise ConfigError(f"format='jax': no device {device!r} here ({exc})") from exc


_ADAPTERS: dict[str, type[Adapter]] = {"numpy": Adapter, "torch": TorchAdapter, "jax": JaxAdapter,
                                       "tensorflow": TensorFlowAdapter}  # fmt: skip


def adapter(fmt: str | None, device: Any = None) -> Adapter:
    """The adapter of ``fmt`` (None: :func:`default_format`) on ``device``. ConfigError for an
    unknown format, a framework that is not installed, or a device it does not have."""
    fmt = default_format() if fmt is None else fmt
    require(fmt)
    return _ADAPTERS[fmt](device)


def adapter_soon(fmt: str | None) -> concurrent.futures.Future[Adapter]:
    """The host-memory adapter of ``fmt``, made on a helper thread: importing a framework takes
    seconds (torch: 2-8 s on a busy host), and a caller bound by a timeout waits for it no
    longer than that, meanwhile waiting for whatever else it needs. An unknown format or a
    framework that is not installed is a :class:`ConfigError` at once."""
    fmt = default_format() if fmt is None else fmt
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt != "numpy" and not importable(fmt):
        raise ConfigError(f'format={fmt!r} needs {fmt}, which is not installed here: pip install "rlink-ucx[{_EXTRAS[fmt]}]"')
    future: concurrent.futures.Future[Adapter] = concurrent.futures.Future()

    def make() -> None:
        try:
            future.set_result(adapter(fmt))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)

    if fmt == "numpy":
        make()
    else:
        threading.Thread(target=make, name=f"rlink-import-{fmt}", daemon=True).start()
    return future
