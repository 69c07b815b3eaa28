"""End to end through a secured cluster: TLS on every port, mTLS between the services, API
keys on the public API (gateway + 1 prefill + 1 decode worker on 127.0.0.1, certificates made
here by ``splitserve/certs.py``).

Also the regression test for the hole of issue #16: the registry was served on the public
port (anyone could register a fake decode worker and receive user traffic), and the workers'
KV channel RPCs were open to anyone who could reach them.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig, SamplingParams
from plumbing.convert import kv_layout_to_proto
from plumbing.identity import frame_tag, mint_id
from plumbing.tls import TlsConfig
from splitserve.certs import Bundle, Issued, issue, make_ca, write_bundle
from splitserve.client import ClientAuth, make_request
from splitserve.cluster import Cluster
from splitserve_api.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kv_transfer_pb2,
)
from tests.e2e.cluster_util import MODEL, code_prompts

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("secure_cluster")]

KEY = "sk-e2e-" + secrets.token_hex(12)
LENGTHS, MAX_TOKENS = [5, 20, 40, 64, 100, 150], [12, 9, 16, 10, 14, 8]  # >= 32 tokens: remote prefill
INTERNAL = ("gateway-internal", "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def ca() -> Issued:
    return make_ca()


@pytest.fixture(scope="module")
def bundle(ca: Issued, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return write_bundle(tmp_path_factory.mktemp("tls"), ca=ca)


@pytest.fixture(scope="module")
def cluster(bundle: Bundle, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    logs = tmp_path_factory.mktemp("logs-secure")
    with Cluster(MODEL, tls=bundle, api_keys=[KEY], log_dir=str(logs), log_level="debug",
                 gateway_flags=["--local-prefill-max-tokens", "32", "--local-prefill-spill-tokens", "0",
                                "--metrics-port", "0"]) as c:  # a port of its own choosing
        yield c


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]], Engine]:
    engine = Engine(EngineConfig(model=MODEL, num_threads=1))
    prompts = code_prompts(engine.tokenizer, LENGTHS)
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS])
    return prompts, [o.token_ids for o in outs], engine


def _generate(cluster: Cluster, prompt: list[int], max_tokens: int, auth: ClientAuth | None = None,
              **kwargs: object) -> tuple[list[int], common_pb2.PhaseTimings]:
    auth = auth or cluster.client
    tokens, timings = [], None
    with auth.channel(cluster.addresses["gateway"]) as channel:
        for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(
                make_request(prompt, max_tokens, **kwargs), timeout=120, metadata=auth.metadata()):
            tokens += list(chunk.token_ids)
            timings = chunk.timings if chunk.finish_reason else timings
    return tokens, timings


def _client(tmp: Path, ca: list[Issued], leaf: Issued | None) -> ClientAuth:
    """A client trusting ``ca`` and presenting ``leaf`` (None: no certificate)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "ca.pem").write_bytes(b"".join(c.cert_pem for c in ca))
    if leaf is None:
        return ClientAuth(tls=TlsConfig(ca_file=str(tmp / "ca.pem")))
    cert, key = leaf.write(tmp, "client")
    return ClientAuth(tls=TlsConfig(cert_file=str(cert), key_file=str(key), ca_file=str(tmp / "ca.pem")))


def _health(address: str, auth: ClientAuth) -> int:
    with auth.channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _bad_clients(tmp: Path, ca: Issued) -> dict[str, ClientAuth]:
    """Clients an internal port must refuse."""
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)
    stranger = make_ca()
    return {
        "no client certificate": _client(tmp / "none", [ca], None),
        "a certificate of another CA": _client(tmp / "other", [ca, stranger], issue(stranger, "intruder")),
        "an expired certificate of the right CA": _client(
            tmp / "expired", [ca], issue(ca, "expired", not_before=past, not_after=past + dt.timedelta(days=1))),
        "plaintext": ClientAuth(),
    }


def test_greedy_parity_through_tls_and_mtls(cluster: Cluster, reference) -> None:  # noqa: ANN001
    prompts, expected, _ = reference
    for prompt, max_tokens, want in zip(prompts, MAX_TOKENS, expected):
        tokens, timings = _generate(cluster, prompt, max_tokens)
        assert tokens == want, len(prompt)
        assert (timings.transfer_bytes > 0) == (len(prompt) >= 32), len(prompt)  # remote prefill over mTLS


def _metric(cluster: Cluster, name: str, labels: dict[str, str]) -> float:
    """The sample ``name`` whose labels include ``labels`` (every sample also names the model)."""
    text = urllib.request.urlopen(f"http://{cluster.metrics_addresses['gateway']}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def test_the_public_api_needs_an_api_key(cluster: Cluster, reference) -> None:  # noqa: ANN001
    prompts, expected, _ = reference
    before = {r: _metric(cluster, "splitserve_auth_failures_total", {"surface": "public", "reason": r})
              for r in ("missing", "invalid")}
    for token, reason in ((None, "missing"), ("sk-wrong", "invalid"), (KEY[:-1], "invalid")):
        auth = ClientAuth(tls=cluster.client.tls, token=token)
        with pytest.raises(grpc.RpcError) as info:
            _generate(cluster, prompts[0], 4, auth)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, reason
    assert _metric(cluster, "splitserve_auth_failures_total", {"surface": "public", "reason": "missing"}) == before["missing"] + 1
    assert _metric(cluster, "splitserve_auth_failures_total", {"surface": "public", "reason": "invalid"}) == before["invalid"] + 2
    # TLS only on the public port (no client certificate asked), the key is what counts.
    keyed = ClientAuth(tls=TlsConfig(ca_file=cluster.client.tls.ca_file), token=KEY)
    assert _generate(cluster, prompts[0], MAX_TOKENS[0], keyed)[0] == expected[0]


def test_internal_ports_refuse_clients_without_a_valid_certificate(cluster: Cluster, ca: Issued,
                                                                   tmp_path: Path) -> None:
    valid = _client(tmp_path / "valid", [ca], issue(ca, "a peer"))
    for name in INTERNAL:
        assert _health(cluster.addresses[name], valid) == health_pb2.HealthCheckResponse.SERVING, name
        for what, auth in _bad_clients(tmp_path, ca).items():
            with pytest.raises(grpc.RpcError) as info:
                _health(cluster.addresses[name], auth)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (name, what)


def _worker_addresses(cluster: Cluster) -> set[str]:
    with cluster.client.channel(cluster.addresses["gateway"]) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5,
                                                             metadata=cluster.client.metadata())
    return {w.address for w in info.workers}


def test_a_worker_cannot_register_on_the_public_port_or_without_a_valid_certificate(
        cluster: Cluster, ca: Issued, tmp_path: Path) -> None:
    fake = gateway_pb2.RegisterWorkerRequest(
        role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:9", model=Path(MODEL).name,
        load=common_pb2.WorkerLoad(kv_blocks_total=64, kv_blocks_free=64), incarnation=mint_id())
    # The hole of issue #16: the public port served the registry. Now it does not, even to a
    # client with a valid API key and a valid certificate.
    with cluster.client.channel(cluster.addresses["gateway"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            gateway_pb2_grpc.WorkerRegistryStub(channel).RegisterWorker(fake, timeout=5,
                                                                        metadata=cluster.client.metadata())
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    for what, auth in _bad_clients(tmp_path, ca).items():
        with auth.channel(cluster.addresses["gateway-internal"]) as channel:
            with pytest.raises(grpc.RpcError) as info:
                gateway_pb2_grpc.WorkerRegistryStub(channel).RegisterWorker(fake, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, what
    assert _worker_addresses(cluster) == {cluster.addresses["prefill-0"], cluster.addresses["decode-0"]}


def test_a_forged_kv_handshake_or_page_write_is_refused_and_serving_goes_on(
        cluster: Cluster, ca: Issued, reference, tmp_path: Path) -> None:  # noqa: ANN001
    import torch

    from plumbing.transport.gloo import GlooRendezvous

    prompts, expected, engine = reference
    decode = cluster.addresses["decode-0"]
    incarnation = mint_id()
    handshake = kv_transfer_pb2.KVChannelHandshake(
        prefill_worker_id=1, transport=kv_transfer_pb2.TRANSPORT_KIND_GLOO,
        kv_layout=kv_layout_to_proto(engine.kv_layout), timeout_ms=20_000, prefill_incarnation=incarnation)
    transfer_id, forged_secret = mint_id(), secrets.token_bytes(16)
    header = kv_transfer_pb2.TransferHeader(
        transfer_id=transfer_id, transfer_secret=forged_secret, request_id=mint_id(), num_blocks=2,
        num_prompt_tokens=20, first_token_id=5, prefill_incarnation=incarnation)
    # Without a valid client certificate nothing gets past the TLS handshake.
    for what, auth in _bad_clients(tmp_path, ca).items():
        with auth.channel(decode) as channel:
            stub = decode_pb2_grpc.DecodeWorkerStub(channel)
            for call, message in ((stub.OpenKVChannel, handshake), (stub.AnnounceTransfer, header)):
                with pytest.raises(grpc.RpcError) as info:
                    call(message, timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, what
    # An insider with a valid certificate opens a channel to itself, but without a transfer's
    # secret no receive is posted for it, and the pages it pushes anyway land nowhere.
    rendezvous = GlooRendezvous("127.0.0.1", timeout_s=20)
    joined: dict[str, object] = {}
    accepting = threading.Thread(target=lambda: joined.update(channel=rendezvous.accept()))
    accepting.start()
    handshake.gloo.host, handshake.gloo.port = rendezvous.host, rendezvous.port
    insider = _client(tmp_path / "insider", [ca], issue(ca, "insider"))
    with insider.channel(decode) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        accept = stub.OpenKVChannel(handshake, timeout=30)
        accepting.join(30)
        header.channel_id, header.decode_incarnation = accept.channel_id, accept.decode_incarnation
        with pytest.raises(grpc.RpcError) as info:
            stub.AnnounceTransfer(header, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        pushed = joined["channel"].send(torch.full(engine.kv_layout.packed_shape(2), 7.0),  # type: ignore[attr-defined]
                                        tag=frame_tag(transfer_id, forged_secret))
        load = stub.GetStats(common_pb2.GetStatsRequest(), timeout=10)
    assert load.kv_blocks_in_transfer == 0 and load.kv_blocks_free == load.kv_blocks_total
    for i in (0, 3):  # the service keeps serving, local and remote prefill, the same tokens
        assert _generate(cluster, prompts[i], MAX_TOKENS[i])[0] == expected[i]
    joined["channel"].close()  # type: ignore[attr-defined]
    pushed.cancel()


def _wait_logged(path: Path, event: str, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path.read_text().count(f'"event": "{event}"') < count:
        assert time.monotonic() < deadline, f"{path.name}: no {event}"
        time.sleep(0.05)


def test_certificates_rotate_on_sighup_mid_stream_without_dropping_it(
        cluster: Cluster, ca: Issued, bundle: Bundle, reference, tmp_path: Path) -> None:  # noqa: ANN001
    prompts, expected, engine = reference
    long_prompt = prompts[2]  # 40 tokens: prefilled remotely, its pages shipped over mTLS-set-up channels
    want = engine.generate([long_prompt], [SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)])[0]
    started, result = threading.Event(), {}

    def long_stream() -> None:
        tokens = []
        try:
            with cluster.client.channel(cluster.addresses["gateway"]) as channel:
                for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(
                        make_request(long_prompt, 400, ignore_eos=True), timeout=120, metadata=cluster.client.metadata()):
                    tokens += list(chunk.token_ids)
                    started.set()
            result["tokens"] = tokens
        except grpc.RpcError as exc:
            result["error"] = exc.code()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(60)
    # A CA change as it is rolled out: the bundle trusts both CAs, the certificate is the new CA's.
    new_ca = make_ca()
    bundle.ca.write_bytes(ca.cert_pem + new_ca.cert_pem)
    fresh = issue(new_ca, "splitserve")
    bundle.key.write_bytes(fresh.key_pem)
    bundle.cert.write_bytes(fresh.cert_pem)
    assert thread.is_alive()  # still streaming while the certificates change
    for proc in cluster.procs.values():
        proc.send_signal(signal.SIGHUP)
    for name in cluster.procs:
        _wait_logged(cluster.log_dir / f"{name}.log", "tls.reloaded", 1)
    thread.join(120)
    assert result.get("tokens") == want.token_ids, result.get("error")
    # Every server presents the new certificate: a client trusting only the new CA gets in...
    only_new = _client(tmp_path / "new", [new_ca], issue(new_ca, "client"))
    for name in ("gateway", *INTERNAL):
        assert _health(cluster.addresses[name], only_new) == health_pb2.HealthCheckResponse.SERVING, name
    # ... and one trusting only the old CA does not.
    only_old = _client(tmp_path / "old", [ca], issue(ca, "client"))
    with pytest.raises(grpc.RpcError):
        _health(cluster.addresses["decode-0"], only_old)
    # The services' own channels are rebuilt with the new certificate for new calls.
    for prompt, max_tokens, tokens in zip(prompts, MAX_TOKENS, expected):
        assert _generate(cluster, prompt, max_tokens)[0] == tokens, len(prompt)
    _wait_logged(cluster.log_dir / "gateway.log", "channel.rotated", 1)


def test_no_key_or_secret_in_any_log_line_and_every_line_is_json(cluster: Cluster) -> None:
    for name in cluster.procs:
        text = (cluster.log_dir / f"{name}.log").read_text()
        assert KEY not in text and KEY[:-1] not in text and "sk-wrong" not in text, name
        assert "PRIVATE KEY" not in text, name
        for line in text.splitlines():
            json.loads(line)
