"""Triton kernels of the fast model path: paged attention, KV store with rotary, norms.

Importing a kernel module imports Triton; callers check :func:`available` first. On a
machine without a GPU the kernels still run under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the import), which is how the CPU test suite checks
them against reference implementations in float32.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any


def interpreting() -> bool:
    """Whether Triton kernels run in its (CPU) interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    triton = sys.modules.get("triton")
    return triton is not None and bool(triton.knobs.runtime.interpret)


def use_interpreter() -> None:
    """Run Triton kernels in Triton's interpreter (on the CPU), for tests and script checks.

    Must come before anything imports Triton: its library functions are decorated at
    import. The switch is kept in Triton's settings rather than the environment, so that
    processes started later do not inherit it. Triton 3.6's interpreter also turns a
    scalar into an int with ``int(array)``, which NumPy 2.4 refuses for one-element
    arrays; that conversion is replaced.
    """
    if "triton" in sys.modules:
        raise RuntimeError("Triton is already imported: its interpreter can no longer be switched on")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        from triton.runtime import interpreter
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.interpret = True
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    interpreter._patch_lang_tensor = patched
    _patch_once_per_kernel(interpreter)
    _no_discarded_overflow_checks(interpreter)


def _no_discarded_overflow_checks(interpreter: Any) -> None:
    """Triton's interpreter sanitizes every 32-bit integer add, sub and mul (the operation again
    in 64 bits, two comparisons, an assert) and then drops the assert unless ``debug`` is on: a
    third of an interpreted GEMV's time for nothing. Off where it would be dropped anyway."""
    import dataclasses

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)  # type: ignore[union-attr]


def _patch_once_per_kernel(interpreter: Any) -> None:
    """Triton's interpreter patches its language modules at every kernel run (and undoes it
    after), and again at every call of a device function inside it: ``inspect.getmembers``
    over each module, never undone, a quarter of an interpreted decode step. Inside a kernel
    run whose patches already cover the modules a device function sees, the second is
    skipped. Left alone where this Triton's interpreter differs."""
    import inspect
    import threading

    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    empty_scope = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or empty_scope is None:
        return
    from triton import language as tl

    run_kernel = executor.__call__
    state = threading.local()  # per thread: which language modules this thread's kernel run patched

    def langs_of(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang_once(fn: Any) -> Any:
        patched = getattr(state, "patched", None)
        if patched is not None and langs_of(fn) <= patched:
            return empty_scope()
        scope = patch_lang(fn)
        if patched is not None:
            patched |= langs_of(fn)
        return scope

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(state, "patched", None)
        state.patched = set()
        try:
            return run_kernel(self, *args, **kwargs)
        finally:
            state.patched = outer

    interpreter._patch_lang = patch_lang_once
    executor.__call__ = run


def available() -> bool:
    """Whether Triton can run here: a CUDA device, or the interpreter switched on."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    return torch.cuda.is_available() or interpreting()


def decode_splits(batch: int, num_kv: int, num_sms: int = 132) -> int:
    """Context splits per sequence so that ``batch * num_kv * splits`` programs fill the GPU
    (one per SM: at batch 1 of a 7B model 32 splits of 32 keys took 5.6 us a layer against
    5.9 for 16 of 64, bench/attention_probe.py on an H200, 2026-12-01)."""
    splits = 1
    while splits < 32 and batch * num_kv * splits * 2 <= num_sms:
        splits *= 2
    return splits
