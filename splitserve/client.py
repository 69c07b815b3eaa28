"""A small gRPC client for the gateway: the ``generate`` command, the tests and the benchmark.

``GatewayClient`` streams ``Generate`` from one gateway or several and continues a stream whose
gateway died on another one (or the same one once it is back), sending the tokens already
received (``GenerateRequest.resume``; the logic is ``plumbing/resume.py``'s, shared with the
HTTP front): each token reaches the caller once, and greedy or seeded output equals the
unbroken stream's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from plumbing.auth import bearer_metadata
from plumbing.resume import LOAD_BALANCING, BrokenStream, ResumableStream, ResumePolicy, gateway_target
from plumbing.rpc import channel_options
from plumbing.tls import TlsConfig, load_material
from splitserve.progress import process_alive, read_status
from splitserve_api.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class ClientAuth:
    """How a client reaches the gateway's public port: TLS (verify the gateway against
    ``tls.ca_file``, the system's roots without one; present ``tls.cert_file`` when given)
    and the API key sent as ``authorization: Bearer``. The default: plaintext, no key."""

    tls: TlsConfig | None = None
    token: str | None = None

    def channel(self, address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A blocking ``grpc`` channel to ``address``."""
        options = [*(options if options is not None else channel_options())]
        if self.tls is None:
            return grpc.insecure_channel(address, options=options)
        m = load_material(self.tls)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(m.ca, m.key, m.cert), options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.token)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientAuth:
        """``--tls-ca``/``--tls-cert``/``--tls-key``/``--tls-server-name`` and ``--token``."""
        tls = None
        if args.tls_ca or args.tls_cert:
            tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                            server_name=args.tls_server_name)
        return cls(tls=tls, token=args.token)


class GatewayClient:
    """``Generate`` that outlives its gateway. ``addresses``: one address (a DNS name is
    resolved to all its A/AAAA records, ``dns:///name:port`` re-resolved as gRPC does), or
    several IP ``addr:port`` (a list or comma-separated); calls go round-robin over those up."""

    def __init__(self, addresses: str | Sequence[str], auth: ClientAuth | None = None,
                 policy: ResumePolicy = ResumePolicy()) -> None:
        self.auth = auth or ClientAuth()
        self.policy = policy
        self.channel = self.auth.channel(gateway_target(addresses), channel_options() + LOAD_BALANCING)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def generate(self, request: gateway_pb2.GenerateRequest, timeout_s: float | None = None,
                 metadata: Sequence[tuple[str, str]] = ()) -> Iterator[gateway_pb2.GenerateResponse]:
        """The request's chunks, each token once, across as many streams as it takes (at most
        ``policy.max_retries`` re-sends, within ``timeout_s``); the last ``grpc.RpcError``
        when it gives up or the error is not one to retry."""
        state = ResumableStream.start(request, self.policy, timeout_s)
        metadata = (*self.auth.metadata(), *metadata)
        while True:
            call = self.stub.Generate(state.next_request(), metadata=metadata, timeout=state.time_left())
            try:
                for chunk in call:
                    yield state.take(chunk)
                if state.finished:
                    return
                error: grpc.RpcError = BrokenStream()
            except grpc.RpcError as exc:
                if state.finished:  # the final chunk came: a cut after it (its gateway killed) loses nothing
                    return
                error = exc
            finally:
                call.cancel()
            time.sleep(state.broke(error))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A conversation: (role, content) turns, role "system", "user" or "assistant".
Chat = Sequence[tuple[str, str]]
_ROLES = {"system": gateway_pb2.CHAT_ROLE_SYSTEM, "user": gateway_pb2.CHAT_ROLE_USER,
          "assistant": gateway_pb2.CHAT_ROLE_ASSISTANT}


def chat_messages(turns: Chat) -> gateway_pb2.ChatMessages:
    """``[("user", "Hi")]`` as the protobuf ``ChatMessages``; an unknown role raises ValueError."""
    messages = gateway_pb2.ChatMessages()
    for role, content in turns:
        if role not in _ROLES:
            raise ValueError(f"chat role must be one of {sorted(_ROLES)}, got {role!r}")
        messages.messages.add(role=_ROLES[role], content=content)
    return messages


def make_request(
    prompt: str | list[int] | gateway_pb2.ChatMessages, max_new_tokens: int, temperature: float = 0.0,
    top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
    ignore_eos: bool = False,
) -> gateway_pb2.GenerateRequest:
    """A ``GenerateRequest`` for prompt text, token ids or a conversation (``chat_messages``)."""
    request = gateway_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0)),
        stopping=common_pb2.StoppingCriteria(max_new_tokens=max_new_tokens, stop_strings=stop or [],
                                             ignore_eos=ignore_eos),
    )
    if seed is not None:
        request.sampling.seed = seed
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, gateway_pb2.ChatMessages):
        request.chat.CopyFrom(prompt)
    else:
        request.token_ids.ids.extend(prompt)
    return request


def make_chat_request(turns: Chat, max_new_tokens: int, **kwargs: Any) -> gateway_pb2.GenerateRequest:
    """``make_request`` for a conversation: the gateway applies the model's chat template and
    stops at its end-of-turn token."""
    return make_request(chat_messages(turns), max_new_tokens, **kwargs)


def wait_for_workers(address: str, num_prefill: int, num_decode: int, timeout_s: float | None,
                     auth: ClientAuth | None = None,
                     watch: Callable[[], None] | None = None) -> gateway_pb2.GetInfoResponse:
    """Poll ``GetInfo`` until the gateway lists enough serving workers of each role: for
    ``timeout_s``, or (None) for as long as ``watch()`` does not raise (the processes progress)."""
    if timeout_s is None and watch is None:
        raise ValueError("wait_for_workers needs a timeout_s or a watch")
    auth = auth or ClientAuth()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last: Exception | None = None
    with auth.channel(gateway_target(address)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        while deadline is None or time.monotonic() < deadline:
            if watch is not None:
                watch()
            try:
                info = stub.GetInfo(gateway_pb2.GetInfoRequest(), timeout=2.0, metadata=auth.metadata())
                roles = [w.role for w in info.workers if w.state == common_pb2.WORKER_STATE_SERVING]
                if (roles.count(common_pb2.WORKER_ROLE_PREFILL) >= num_prefill
                        and roles.count(common_pb2.WORKER_ROLE_DECODE) >= num_decode):
                    return info
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.1)
    raise TimeoutError(f"gateway {address} did not list {num_prefill} prefill + {num_decode} decode "
                       f"workers within {timeout_s} s ({last})")


def wait_for_up(status_file: str, appear_s: float) -> str:
    """Wait for ``splitserve up`` (its ``--status-file``) while it is starting and alive, for no
    fixed time (``up`` itself gives up on services that stop progressing); the gateway address
    once it is ready. ``appear_s`` bounds only the wait for the file to appear."""
    appear_by = time.monotonic() + appear_s
    while True:
        status = read_status(status_file)
        if status is None:
            if time.monotonic() > appear_by:
                raise TimeoutError(f"{status_file}: no status from splitserve up within {appear_s} s")
        elif status["state"] == "ready":
            return str(status["gateway"])
        elif status["state"] != "starting" or not process_alive(int(status["pid"])):
            state = status["state"] if status["state"] != "starting" else "exited"
            raise RuntimeError(f"splitserve up (pid {status['pid']}) {state} before it was ready: "
                               f"{status.get('error', 'see its log')}")
        time.sleep(0.2)


def cli_chat_turns(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """``generate --chat MESSAGE [--system TEXT]`` as turns; None for a plain prompt."""
    if args.chat is None:
        return None
    return ([("system", args.system)] if args.system else []) + [("user", args.chat)]


def stream_to_terminal(args: argparse.Namespace) -> int:
    """``splitserve generate``: stream text to stdout; the finish reason and timings to stderr."""
    try:
        auth = ClientAuth.from_args(args)
        if args.wait_for_up:
            wait_for_up(args.wait_for_up, args.wait_s)
        wait_for_workers(args.gateway, args.min_prefill_workers, 1, args.wait_s, auth)
    except (TimeoutError, ValueError, RuntimeError) as exc:
        sys.stderr.write(f"splitserve generate: {exc}\n")
        return 1
    turns = cli_chat_turns(args)
    prompt = args.prompt if turns is None else chat_messages(turns)
    request = make_request(prompt, args.max_tokens, args.temperature, args.top_p, args.top_k,
                           args.seed, args.stop)
    with GatewayClient(args.gateway, auth) as client:
        if turns is None:  # a completion continues the prompt; a chat answer stands alone
            sys.stdout.write(args.prompt)
            sys.stdout.flush()
        try:
            for chunk in client.generate(request, timeout_s=args.timeout_s):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    t = chunk.timings
                    sys.stderr.write(
                        f"\n[finish_reason={common_pb2.FinishReason.Name(chunk.finish_reason)} "
                        f"ttft_ms={t.first_token_us / 1000:.1f} total_ms={t.total_us / 1000:.1f} "
                        f"prefill_ms={t.prefill_us / 1000:.1f} transfer_ms={t.transfer_us / 1000:.1f} "
                        f"transfer_bytes={t.transfer_bytes}]\n"
                    )
        except grpc.RpcError as exc:
            sys.stderr.write(f"\nsplitserve generate: {exc.code().name}: {exc.details()}\n")
            return 1
    return 0
