"""The frame check every transport runs before a receive completes (NCCL runs it before the
payload is even posted): order, then the transfer's tag, then the size."""

from __future__ import annotations

import pytest
import torch

from plumbing.transport import TransportError
from plumbing.transport.framed import CANCELLED, check_frame


def test_a_frame_for_this_op_and_tag_passes() -> None:
    assert check_frame(3, (3, 16, -7), torch.empty(4), -7) is False
    assert check_frame(3, (3, CANCELLED, -7), torch.empty(4), -7) is True


@pytest.mark.parametrize("frame, error", [
    ((4, 16, 9), "out of order"),
    ((3, 16, 8), "tag mismatch"),
    ((3, CANCELLED, 8), "tag mismatch"),  # a cancel for another transfer is a mismatch too
    ((3, 12, 9), "size mismatch"),
])
def test_any_mismatch_is_a_transport_error(frame: tuple[int, int, int], error: str) -> None:
    with pytest.raises(TransportError, match=error):
        check_frame(3, frame, torch.empty(4), 9)
