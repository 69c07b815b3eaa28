"""A page write without the transfer's secret (issue #16): the receive posted for transfer A
refuses pages framed with A's id but not A's secret; nothing is written into A's blocks,
and the reservation fails cleanly. (Pages for another transfer: ``test_kv_inbox.py``.)"""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch

from plumbing.identity import frame_tag
from decode_worker.reservation import Phase
from tests.decode_worker.test_kv_inbox import PREFILL_INCARNATION, Harness, _pages_like, _pair, until_phase


def test_pages_framed_without_the_transfers_secret_never_land() -> None:
    async def run() -> None:
        h = Harness(asyncio.get_running_loop())
        sender, receiver = _pair()
        channel_id = h.inbox.channels.add(receiver, PREFILL_INCARNATION)
        a = await h.reserve("404", 40)
        before = h.pages(a).clone()
        h.inbox.announce(h.header(a, channel_id))  # the receive is posted for A
        guessed = secrets.token_bytes(len(a.secret))  # A's transfer id is known, its secret is not
        forged = sender.send(_pages_like(h, a, 9.0), tag=frame_tag(a.transfer_id, guessed))
        with pytest.raises(Exception, match="tag mismatch"):
            await asyncio.wait_for(asyncio.wrap_future(forged), 10)
        await until_phase(a, Phase.FAILED)
        assert a.transfer_id not in h.table.pending and receiver.broken
        assert torch.equal(h.pages(a), before)  # not one page written
        assert "404" in h.pushed  # the decode stream is told; its blocks are freed by the table
        h.engine.check_integrity()
        sender.close()
        receiver.close()

    asyncio.run(run())
