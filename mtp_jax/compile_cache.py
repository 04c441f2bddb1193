"""Warm starts: JAX's persistent compilation cache and saved executables, on by default.

Every `generate` / `evaluate` run and every `Engine` compiles the same programs for the
same model and engine shapes; with the cache the second run loads them from disk instead
of compiling again. The folder is `--compile-cache` (`enable(path)`), else
`$MTP_JAX_COMPILE_CACHE`, else `<user cache dir>/mtp_jax/jax-<jax version>`
(`$XDG_CACHE_HOME` or `~/.cache`); the value `off` disables it for the process. A cache
folder the user already gave JAX (`jax_compilation_cache_dir`) is left as it is. Programs
whose executables JAX cannot serialize (host callbacks, e.g. Pallas interpret mode) are
simply compiled each time.

JAX's cache saves XLA's work, but finding a program in it still means tracing the program
and lowering it to compute its key: most of a warm start on CPU. So an engine (on one
device or a mesh of one process) also keeps each program's executable whole
(`ExecutableStore`, the folder's `executables/`), keyed by everything the program is built
from: this package's and `pallas_kernels`' source, the jax / jaxlib versions, the devices,
`XLA_FLAGS`, the kernel
back-end switches (`MTP_JAX_*_BACKEND`) and jax options read while tracing, the program's
name, the engine's static configuration, the model's graph and the arguments' shapes,
dtypes and placement. A later engine with the same key loads the executable and calls it:
no tracing, lowering or compiling. What the store saves it compiles itself, past JAX's
cache (`_compile_fresh` says why). What cannot be saved or loaded (a host callback, a file
from another jaxlib) is compiled as before. The saved files are native code loaded
and run (as JAX's own cache entries are): the folder must be one only the user writes.

A saved executable runs on the devices it was compiled for: the file records their ids in
the executable's own order and the load binds it to those devices (loaded for every device
the process sees instead, a one-device program is refused when called on a machine of
several devices; a mesh program in another device order can abort the process). The key
holds those devices' ids and kinds, the mesh, and the client memory settings
(`XLA_PYTHON_CLIENT_*`) and TPU flags (`LIBTPU_INIT_ARGS`) that XLA compiles against. An
executable that cannot be loaded here, or whose first call is refused, is compiled afresh
and its file replaced (`CacheStats.replaced`); an error the fresh executable raises too is
the program's own and surfaces.

`CacheStats` counts hits and misses from JAX's own monitoring events, and the executables
loaded, saved and replaced, for run summaries.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib
import os
import pickle
import threading
from typing import Callable, Optional

import jax

ENV_VAR = "MTP_JAX_COMPILE_CACHE"
OFF = ("off", "0", "false", "none", "no")

_lock = threading.Lock()
_counts = {"hits": 0, "misses": 0, "loaded": 0, "saved": 0, "replaced": 0}
_listening = False
_disabled = False


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mtp_jax", f"jax-{jax.__version__}")


def _listen(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _counts["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _counts["misses"] += 1


def enable(path: Optional[str] = None) -> Optional[str]:
    """Turn the persistent cache on (see the module doc); returns its folder or None.

    path: a folder, `off`, or None for $MTP_JAX_COMPILE_CACHE / the default folder. Once
    turned off in a process (by either), later calls with path None leave it off.
    """
    global _listening, _disabled
    choice = path if path is not None else os.environ.get(ENV_VAR)
    if choice is not None and str(choice).strip().lower() in OFF:
        _disabled = True
        return None
    if path is None and _disabled:
        return None
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_listen)
            _listening = True
        current = jax.config.jax_compilation_cache_dir
        if current:
            return current
        folder = os.path.abspath(os.path.expanduser(choice or default_dir()))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return None  # a read-only home: run without the cache rather than fail
        jax.config.update("jax_compilation_cache_dir", folder)
        # CPU programs are many and each compiles in well under JAX's 1 s default floor.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _reset_jax_cache()  # a process that compiled before this call decided "no cache"
        return folder


def _reset_jax_cache() -> None:
    """Make JAX look at its cache settings again: it decides once per process whether its
    persistent cache is used."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def add_compile_cache_option(parser) -> None:
    parser.add_argument("--compile-cache", metavar="DIR|off",
                        help=f"persistent compilation cache folder, or off (default: "
                             f"${ENV_VAR}, else {default_dir()})")


class CacheStats:
    """Persistent-cache hits and misses, executables loaded and saved, since this object
    was made."""

    def __init__(self):
        self._start = dict(_counts)

    def _since(self, name: str) -> int:
        return _counts[name] - self._start[name]

    hits = property(lambda self: self._since("hits"))
    misses = property(lambda self: self._since("misses"))
    loaded = property(lambda self: self._since("loaded"))  # executables loaded whole
    saved = property(lambda self: self._since("saved"))
    # saved executables that could not be used here (load or first call refused): compiled
    # afresh and their files rewritten
    replaced = property(lambda self: self._since("replaced"))

    def __str__(self) -> str:
        folder = jax.config.jax_compilation_cache_dir
        if not folder:
            return "compile cache off"
        line = (f"compile cache {self.hits} hits / {self.misses} misses, executables "
                f"{self.loaded} loaded / {self.saved} saved ({folder})")
        if self.replaced:
            line += (f"\ncompile cache: {self.replaced} saved executables could not run here "
                     f"and were compiled afresh (their files replaced)")
        return line


# ------------------------------------------------------------------ saved executables
_FORMAT = 2  # bump when what is saved, or how the key is made, changes


@functools.cache
def _source_digest() -> str:
    """The source of this package and of pallas_kernels: a changed line changes every key."""
    import pallas_kernels

    h = hashlib.sha256()
    for pkg in (os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.abspath(pallas_kernels.__file__))):
        for name in sorted(os.listdir(pkg)):
            if name.endswith(".py"):
                with open(os.path.join(pkg, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


# Environment variables XLA reads when it compiles or sizes its client: compile flags and
# the client's memory settings (an executable tuned against one memory budget is not one
# to reuse under another).
_COMPILE_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_GPU_ALLOCATOR")


def _environment() -> str:
    """What else shapes a traced or compiled program: versions, platform, flags, switches.
    (The devices a program runs on are keyed per program: `_placement`.)"""
    import jaxlib

    dev = jax.devices()[0]
    switches = sorted((k, v) for k, v in os.environ.items()  # the kernel back-end choices
                      if k.startswith("MTP_JAX_") and k.endswith("_BACKEND"))
    options = [(name, getattr(jax.config, name, None)) for name in (
        "jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
        "jax_default_prng_impl", "jax_threefry_partitionable")]
    return repr((_FORMAT, _source_digest(), jax.__version__, jaxlib.__version__,
                 dev.platform, dev.client.platform_version, jax.process_count(),
                 [(k, os.environ.get(k)) for k in _COMPILE_ENV], switches, options))


def _sharding_devices(sharding) -> tuple:
    """The devices of a sharding in its layout order: a mesh's in mesh order (a program over
    the same devices in another order is another program), else sorted by id."""
    mesh = getattr(sharding, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return tuple(devices.flat)
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def _placement(args) -> str:
    """The devices the arguments live on, with each device's kind: part of every key, so an
    executable is only ever looked up for the devices (and kinds) it was compiled for."""
    seen = []
    for x in jax.tree_util.tree_leaves(args):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            continue
        devices = tuple((d.id, d.device_kind) for d in _sharding_devices(sharding))
        if devices not in seen:
            seen.append(devices)
    if not seen:  # no array argument: the program runs on the default device
        d = jax.devices()[0]
        seen.append(((d.id, d.device_kind),))
    return repr(seen)


def _device_ids(compiled) -> list:
    """The ids of the devices an executable was compiled for, in its own order (the order
    its shards are laid out in), which is the order the load must bind it to."""
    unloaded = compiled._executable._unloaded_executable
    devices = getattr(unloaded, "device_list", None)
    if devices is None:  # a jax that keeps only the runtime executable's list
        devices = compiled._executable.xla_executable.local_devices()
    return [d.id for d in devices]


def _mosaic_gpu_runtime() -> None:
    """On a GPU, import jax's Mosaic GPU module before any executable is loaded. A saved
    program that calls a Mosaic GPU kernel (pallas_kernels.swiglu_matmul) links its host
    code against the Mosaic GPU runtime library, which that import locates
    ($MOSAIC_GPU_RUNTIME_LIB_PATH). A process that loads executables without tracing never
    imports it, and the load fails ("Symbols not found: mosaic_gpu_init_tma_desc, ...")
    into a compile."""
    if jax.devices()[0].platform != "gpu":
        return
    try:
        importlib.import_module("jax.experimental.mosaic.gpu")
    except ImportError:  # a jax without Mosaic GPU: no such kernels either
        pass


def _signature(args) -> str:
    leaves, tree = jax.tree_util.tree_flatten(args)

    def leaf(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            sharding = getattr(x, "sharding", None)
            return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                    type(x).__name__, repr(sharding) if sharding is not None else None)
        return (type(x).__name__,)  # a Python scalar: weakly typed, traced by its type

    return repr((str(tree), [leaf(x) for x in leaves]))


class ExecutableStore:
    """Compiled programs saved whole in `folder`, loaded without tracing (module doc).

    `context` names what the program was traced from beyond its arguments (the engine's
    static configuration and the model's graph); the store adds the environment."""

    def __init__(self, folder: str):
        self.folder = folder
        self._env = _environment()
        _mosaic_gpu_runtime()

    def key(self, name: str, context: str, args) -> str:
        text = "\0".join((self._env, name, context, _signature(args), _placement(args)))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, name: str, context: str, args) -> str:
        return os.path.join(self.folder, self.key(name, context, args) + ".bin")

    def load(self, name: str, context: str, args) -> Optional[Callable]:
        """The saved executable for these arguments, or None when the store has none that
        loads here. Traces nothing, so worker threads may load several at once."""
        path = self._path(name, context, args)
        compiled = _load(path) if os.path.exists(path) else None
        if compiled is not None:
            with _lock:
                _counts["loaded"] += 1
        return compiled

    def get(self, jitted, name: str, context: str, args) -> tuple[Callable, bool]:
        """(executable of `jitted(*args)`, whether it was loaded): loaded if saved before
        and loadable here, else compiled (not through JAX's own cache, see _compile_fresh)
        and saved. A file that exists but cannot be loaded is replaced."""
        compiled = self.load(name, context, args)
        if compiled is not None:
            return compiled, True
        path = self._path(name, context, args)
        if os.path.exists(path):
            with _lock:
                _counts["replaced"] += 1
        return self._compile_and_save(jitted, path, args), False

    def replace(self, jitted, name: str, context: str, args) -> Callable:
        """A loaded executable whose first call was refused: compile it afresh and overwrite
        its file."""
        with _lock:
            _counts["replaced"] += 1
        return self._compile_and_save(jitted, self._path(name, context, args), args)

    def compile_many(self, items: list, threads: int) -> list:
        """Executables of `items` [(jitted, name, context, args)], compiled on up to
        `threads` worker threads and saved: each is traced here, in order (tracing reads
        this thread's mesh and numerics switches), then XLA compiles them side by side.
        An item whose compile fails gets None (its caller compiles it again alone, and
        meets the error there)."""
        lowered = [jitted.lower(*args) for jitted, _, _, args in items]
        compiled = _compile_fresh_many(lowered, threads)
        return [None if c is None else self._save(c, self._path(name, context, args))
                for c, (_, name, context, args) in zip(compiled, items)]

    def _compile_and_save(self, jitted, path: str, args) -> Callable:
        return self._save(_compile_fresh(jitted.lower(*args)), path)

    def _save(self, compiled, path: str) -> Callable:
        """Write `compiled` to `path` (when it serializes and the folder takes it)."""
        from jax.experimental import serialize_executable

        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            data = pickle.dumps((blob, in_tree, out_tree, _device_ids(compiled)))
        except Exception:  # noqa: BLE001 (host callbacks, constants: not serializable)
            return compiled
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # whole or not at all, whoever else writes it
        except OSError:  # a read-only or full cache folder: run without saving
            try:
                os.remove(tmp)
            except OSError:
                pass
            return compiled
        with _lock:
            _counts["saved"] += 1
        return compiled


def _load(path: str):
    """The executable saved at `path`, bound to the devices it was compiled for; None when it
    cannot be loaded here (damaged, another jaxlib, a device this process lacks)."""
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            blob, in_tree, out_tree, ids = pickle.load(f)
        local = {d.id: d for d in jax.local_devices()}
        if not ids or any(i not in local for i in ids):
            return None
        return serialize_executable.deserialize_and_load(
            blob, in_tree, out_tree, backend=local[ids[0]].client,
            execution_devices=[local[i] for i in ids])
    except Exception:  # noqa: BLE001 (damaged, another format or jaxlib)
        return None


@contextlib.contextmanager
def _past_jax_cache():
    """JAX's persistent cache off while the compiles inside run (one set of them at a
    time: the switch is global)."""
    was = jax.config.jax_enable_compilation_cache
    with _lock:
        jax.config.update("jax_enable_compilation_cache", False)
        _reset_jax_cache()
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", was)
            _reset_jax_cache()


def _compile_fresh(lowered):
    """lowered.compile() by XLA itself, with JAX's persistent cache out of the way.

    An executable that JAX loaded from its cache serializes into one that cannot run on
    CPU (jaxlib 0.10.2: loaded in any process, its first call fails with `NOT_FOUND:
    Function ... not found`), so what the store saves must be compiled here. The store
    holds these programs, so JAX's cache does not need them either."""
    with _past_jax_cache():
        return lowered.compile()


def _compile_fresh_many(lowered: list, threads: int) -> list:
    """[lowered.compile()] as `_compile_fresh` does, on up to `threads` threads at once;
    None where a compile raised."""
    def one(x):
        try:
            return x.compile()
        except Exception:  # noqa: BLE001 (surfaces when the caller compiles it alone)
            return None

    with _past_jax_cache(), concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        return list(pool.map(one, lowered))


_stores: dict = {}  # folder -> ExecutableStore


def executable_store() -> Optional[ExecutableStore]:
    """The store of this process's cache folder; None when the cache is off or the process
    is one of several (multi-host programs are not saved: each process would hold only its
    part of an executable whose other parts live in processes it cannot check)."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or jax.process_count() > 1:
        return None
    folder = os.path.join(folder, "executables")
    with _lock:
        if _stores.get(folder) is None:
            _stores[folder] = ExecutableStore(folder)
        return _stores[folder]


__all__ = ["ENV_VAR", "CacheStats", "ExecutableStore", "add_compile_cache_option",
           "default_dir", "enable", "executable_store"]
