"""``splitserve up``'s cold start: the workers spawn beside the gateways, not once they listen
(``Cluster(early_workers=True)``), told each gateway's internal port picked ahead; they load
their model meanwhile and register with every gateway once it listens. Two gateway replicas,
real processes, the bundled model."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.cluster import Cluster, mint_secret
from tests.e2e.cluster_util import MODEL, greedy_requests, stream

pytestmark = pytest.mark.xdist_group("early_workers")


def test_workers_spawn_before_the_gateways_listen_and_serve_through_each(tmp_path: Path, monkeypatch) -> None:
    spawned_before: dict[str, list[str]] = {}
    ready = Cluster._ready

    def spy(self: Cluster, name: str, *args: object) -> str:  # which processes ran when name's wait began
        spawned_before.setdefault(name, sorted(self.procs))
        return ready(self, name, *args)

    monkeypatch.setattr(Cluster, "_ready", spy)
    cluster = Cluster(MODEL, num_prefill=1, num_decode=1, num_gateways=2, early_workers=True,
                      log_dir=str(tmp_path), internal_secret=mint_secret(),
                      gateway_flags=["--local-prefill-max-tokens", "0"])
    with cluster:
        assert spawned_before["gateway"] == ["decode-0", "gateway", "gateway-1", "prefill-0"]
        internal = ",".join(cluster.addresses[f"{n}-internal"] for n in cluster.gateway_names)
        for worker in ("prefill-0", "decode-0"):
            flags = cluster._commands[worker][1]
            assert flags[flags.index("--gateway") + 1] == internal
        public = {cluster.addresses[n].rsplit(":", 1)[1] for n in cluster.gateway_names}
        assert not public & {a.rsplit(":", 1)[1] for a in internal.split(",")}
        outs = [stream(address, greedy_requests([[5, 6, 7, 8, 9, 10]], [4])[0]) for address in cluster.gateway_addresses]
    assert [o.error for o in outs] == [None, None]
    assert [len(o.token_ids) for o in outs] == [4, 4] and outs[0].token_ids == outs[1].token_ids
    assert all(o.timings.transfer_bytes > 0 for o in outs)  # prefilled on the prefill worker, pages shipped
