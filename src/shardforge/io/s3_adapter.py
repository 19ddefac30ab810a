"""The one place that uses s3fs's internals: its private coroutine `_call_s3` (a botocore
request with every keyword the store takes: conditional GETs, multipart uploads), its event
loop, and the S3 error code behind an error it translated. Every other module makes requests
through these functions, and tells failures apart by `kind` (an error's type and S3 code),
never by the words of a message.

    out = call(fs, "list_objects_v2", Bucket=b, Prefix=p)        # on the file system's loop
    out = call_waiting(fs, "put_object", 60.0, Bucket=b, Key=k, Body=data)  # a signal waits
    resp = await acall(fs, "get_object", Bucket=b, Key=k, Range="bytes=0-9")  # on its loop
    n = run(fs, coroutine_function, *args)                       # a coroutine on its loop
    kind(exc)   # "missing", "changed", "denied", "unreachable" or "failed"
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# the S3 error codes of a key, an upload or a bucket that does not exist
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchUpload", "NoSuchBucket", "404", "NotFound"})
# the error codes of a conditional GET whose pinned version is gone (412: If-Match failed;
# 416: a range past the end of what the key holds now)
CHANGED_CODES = frozenset({"PreconditionFailed", "412", "InvalidRange", "416"})
DENIED_CODES = frozenset({"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "403"})


async def acall(fs: Any, method: str, **kwargs: Any) -> Any:
    """The botocore request `method` on `fs`'s client (run on `fs`'s event loop)."""
    return await fs._call_s3(method, **kwargs)


def run(fs: Any, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` run on `fs`'s event loop, waited for; its result."""
    from fsspec.asyn import sync

    return sync(fs.loop, fn, *args, **kwargs)


def call(fs: Any, method: str, **kwargs: Any) -> Any:
    """The request `method`, waited for."""
    return run(fs, acall, fs, method, **kwargs)


def call_waiting(fs: Any, method: str, wait_s: float, **kwargs: Any) -> Any:
    """The request `method`; a signal (SIGTERM, Ctrl-C) that interrupts the wait waits for the
    request's answer (at most `wait_s`) before it goes on: what the request makes exists before
    a cleanup that follows removes it."""
    future = asyncio.run_coroutine_threadsafe(acall(fs, method, **kwargs), fs.loop)
    try:
        return future.result()
    except Exception:
        raise
    except BaseException:
        with contextlib.suppress(BaseException):
            future.result(timeout=wait_s)
        raise


def error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an error s3fs translated (None: not a store's answer)."""
    for cause in (exc, exc.__cause__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            return None if code is None else str(code)
    return None


def kind(exc: BaseException) -> str:
    """What a failed request says, by the error's type and S3 code: "missing" (no such key,
    upload or bucket), "changed" (a pinned version is gone), "denied" (credentials),
    "unreachable" (no connection to the store) or "failed" (anything else)."""
    code = error_code(exc)
    if isinstance(exc, FileNotFoundError) or code in MISSING_CODES:
        return "missing"
    if code in CHANGED_CODES:
        return "changed"
    if isinstance(exc, PermissionError) or code in DENIED_CODES:
        return "denied"
    if _unreachable(exc):
        return "unreachable"
    return "failed"


def _unreachable(exc: BaseException) -> bool:
    """No connection to the store: refused, reset, timed out, or the endpoint not found."""
    seen: BaseException | None = exc
    for _ in range(4):  # the error and the causes s3fs and botocore chained to it
        if seen is None:
            return False
        if isinstance(seen, ConnectionError | TimeoutError):
            return True
        module = type(seen).__module__
        if module.startswith(("aiohttp", "botocore")) and "Connect" in type(seen).__name__:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
