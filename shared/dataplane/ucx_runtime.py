"""The process's one UCX context, shared by every UCX server and client in it, counted by its users.

ucxx completes requests through asyncio futures set by a notifier thread (``enable_python_future``);
without it every pending receive would spin the event loop. That thread serves the event loop that
created the context, so the context lives as long as that loop is used (a service's whole life); it
is rebuilt only for a new loop once nobody uses the old one. The thread is not a daemon: a hook stops
it before the interpreter joins threads at exit, so a process that never stopped its plane still exits.
"""

from __future__ import annotations

import asyncio
import os
import threading

from shared.logging import get_logger

log = get_logger(__name__)

_state = {"users": 0, "loop": None, "ucxx": None, "cuda": None, "exit_hook": False}
_lock = threading.Lock()


def module():
    """The ucxx module (import is deferred: deployments without the ucx extra never load it)."""
    if _state["ucxx"] is None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx
        except ImportError as err:
            raise RuntimeError("the ucx data plane needs ucxx: pip install 'epd[ucx]' (x86_64 Linux)") from err
        _state["ucxx"] = ucxx
    return _state["ucxx"]


def acquire():
    """The ucxx module with a context bound to the running event loop; pair with ``release``."""
    ucxx = module()
    loop = asyncio.get_running_loop()
    with _lock:
        if _state["loop"] is not None and _state["loop"] is not loop and _state["users"] == 0:
            _shutdown(reset=True)  # the old loop's context: no user left; its notifier serves that loop
        if _state["loop"] is None:
            try:
                ucxx.init(options=_options(), env_takes_precedence=True, progress_mode="thread",
                          enable_python_future=True)
            except RuntimeError:
                log.warning("ucx.already_initialized")  # someone else's settings; still usable
            _state["loop"] = loop
            if not _state["exit_hook"]:
                threading._register_atexit(_shutdown)  # runs before the interpreter joins threads
                _state["exit_hook"] = True
        elif _state["loop"] is not loop:
            raise RuntimeError("the UCX data plane is bound to another event loop of this process")
        _state["users"] += 1
    return ucxx


def _options() -> dict[str, str]:
    """Our defaults; a ``UCX_*`` environment variable of the same name wins (UCX_RNDV_SCHEME=auto
    restores UCX's own choice)."""
    # Over TCP, 'auto' picks a fragmented copy-in/copy-out rendezvous: 0.5 GB/s on loopback here, and
    # 1.2 GB/s from an H200 host's GPU to another process's host memory, where writing straight from
    # the sender's buffer (put_zcopy) gave 1.3-2.9 GB/s (bench/dataplane.py, docs/benchmarks.md).
    # GPU to GPU over cuda_ipc measured the same either way (250-310 GB/s).
    return {"RNDV_SCHEME": "put_zcopy"}


def release() -> None:
    with _lock:
        _state["users"] -= 1


def _shutdown(reset: bool = False) -> None:
    ucxx = _state["ucxx"]
    if ucxx is None or _state["loop"] is None:
        return
    _state["loop"] = None
    ucxx.stop_notifier_thread()
    if reset:
        try:
            ucxx.reset()
        except Exception as err:  # an endpoint still referenced somewhere: that context lingers, unused
            log.debug("ucx.reset_failed", error=str(err))


def cuda_support() -> bool:
    """Whether this UCX can move GPU memory itself (cuda_copy / cuda_ipc, RDMA with GPUDirect)."""
    if _state["cuda"] is None:
        _state["cuda"] = any(t.startswith("cuda") for t in module().get_active_transports())
    return _state["cuda"]
