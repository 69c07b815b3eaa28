"""Bearer tokens: API keys on the public API, the shared secret on internal ports.

A caller sends ``authorization: Bearer <token>`` (or ``x-api-key: <token>``). The server
interceptor compares it, in constant time, with every accepted token (SHA-256 digests
compared with ``hmac.compare_digest``, all of them, whatever matched first) and answers
UNAUTHENTICATED when it is missing or wrong, counting the refusal by surface and reason.
No token, presented or accepted, is ever logged: refusals log the method, the reason and
the peer.

Tokens come from a file (one a line; blank lines and ``#`` comments skipped), re-read on
SIGHUP or when it changes, and/or from a comma-separated value (flag or ``SPLITSERVE_*``
variable). Health checks are exempt (probes carry no credentials, and a health status
reveals nothing).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog

log = structlog.get_logger()

AUTHORIZATION_KEY = "authorization"
API_KEY_KEY = "x-api-key"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenSet:
    """The accepted tokens of one surface (event-loop owned; ``reload`` swaps the list)."""

    def __init__(self, name: str, file: str | None = None, inline: str | None = None) -> None:
        self.name = name  # e.g. "api_keys", used in messages (never the tokens)
        self.file = file
        self.inline = inline
        self._stamp: tuple[int, int, int] | None = None
        self._digests: list[bytes] = []
        self._tokens: list[str] = []
        self._load()

    def _read(self) -> list[str]:
        tokens = [t.strip() for t in (self.inline or "").split(",") if t.strip()]
        if self.file is not None:
            try:
                lines = open(self.file, encoding="utf-8").read().splitlines()  # noqa: SIM115
            except OSError as exc:
                raise ValueError(f"{self.name}_file: cannot read {self.file}: {exc.strerror}") from None
            tokens += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        for token in tokens:
            if any(c.isspace() for c in token) or not token.isprintable():
                raise ValueError(f"{self.name}: a token must be printable and without spaces")
        return tokens

    def _load(self) -> None:
        tokens = self._read()
        if (self.file is not None or self.inline) and not tokens:
            raise ValueError(f"{self.name}: no token given (an empty file or value)")
        self._tokens = tokens
        self._digests = [_digest(t) for t in tokens]
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self.file is None:
            return None
        try:
            st = os.stat(self.file)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload(self, force: bool = False) -> bool:
        """Re-read the file when it changed (or ``force``); keep the old tokens on error."""
        if self.file is None or (not force and self._file_stamp() == self._stamp):
            return False
        try:
            self._load()
        except ValueError as exc:
            log.warning("auth.reload_failed", tokens=self.name, error=str(exc))
            return False
        log.info("auth.reloaded", tokens=self.name, num_tokens=len(self._digests))
        return True

    @property
    def configured(self) -> bool:
        return bool(self._digests)

    def accepts(self, presented: str) -> bool:
        """Constant time in the token's content: every digest is compared."""
        digest = _digest(presented)
        found = False
        for accepted in self._digests:
            found |= hmac.compare_digest(digest, accepted)
        return found

    def first(self) -> str:
        """The token a client sends (the internal shared secret)."""
        return self._tokens[0]


def presented_token(metadata: Any) -> str | None:
    """The token in ``authorization: Bearer`` or ``x-api-key`` metadata, else None."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif key == API_KEY_KEY and str(value).strip():
            return str(value).strip()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without an accepted token on one surface ("public",
    "internal"); ``on_refused(surface, reason)`` counts them."""

    def __init__(self, tokens: TokenSet, surface: str, on_refused: Callable[[str, str], None]) -> None:
        self._tokens = tokens
        self._surface = surface
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        token = presented_token(details.invocation_metadata)
        if token is not None and self._tokens.accepts(token):
            return handler
        reason = "missing" if token is None else "invalid"
        self._on_refused(self._surface, reason)
        log.info("auth.refused", surface=self._surface, method=details.method, reason=reason)
        message = ("missing credentials: send 'authorization: Bearer <token>'" if token is None
                   else "the token is not accepted here")
        return _refusing(handler, message)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED."""
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    args = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, *args)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, *args)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, *args)
    return grpc.stream_stream_rpc_method_handler(streaming, *args)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none without one)."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()
