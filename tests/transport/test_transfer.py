"""Transfer: forward-only states, FAILED absorbing, DONE terminal, wait() across threads."""

from __future__ import annotations

import threading

import pytest

from plumbing.transport import InvalidTransition, Transfer, TransferState

S = TransferState


def test_starts_pending_and_walks_forward() -> None:
    transfer = Transfer(7)
    assert (transfer.transfer_id, transfer.state, transfer.error) == (7, S.PENDING, None)
    for state in (S.BOOTSTRAPPING, S.TRANSFERRING, S.DONE):
        transfer.advance(state)
        assert transfer.state is state
    assert transfer.finished
    assert list(transfer.entered_at) == [S.PENDING, S.BOOTSTRAPPING, S.TRANSFERRING, S.DONE]


def test_forward_skips_are_allowed() -> None:
    transfer = Transfer(1)
    transfer.advance(S.TRANSFERRING)
    assert transfer.state is S.TRANSFERRING
    transfer.advance(S.DONE)
    assert transfer.state is S.DONE


@pytest.mark.parametrize(
    ("reached", "target"),
    [
        (S.BOOTSTRAPPING, S.PENDING),
        (S.TRANSFERRING, S.BOOTSTRAPPING),
        (S.TRANSFERRING, S.PENDING),
        (S.BOOTSTRAPPING, S.BOOTSTRAPPING),
        (S.PENDING, S.PENDING),
    ],
)
def test_backward_or_same_is_rejected(reached: TransferState, target: TransferState) -> None:
    transfer = Transfer(1)
    if reached is not S.PENDING:
        transfer.advance(reached)
    with pytest.raises(InvalidTransition):
        transfer.advance(target)
    assert transfer.state is reached


def test_advance_to_failed_must_go_through_fail() -> None:
    transfer = Transfer(1)
    with pytest.raises(InvalidTransition, match="fail"):
        transfer.advance(S.FAILED)
    assert transfer.state is S.PENDING


@pytest.mark.parametrize("reached", [S.PENDING, S.BOOTSTRAPPING, S.TRANSFERRING])
def test_fail_from_any_non_terminal_state(reached: TransferState) -> None:
    transfer = Transfer(1)
    if reached is not S.PENDING:
        transfer.advance(reached)
    assert transfer.fail("peer died") is True
    assert (transfer.state, transfer.error, transfer.finished) == (S.FAILED, "peer died", True)


def test_failed_is_absorbing_and_keeps_first_reason() -> None:
    transfer = Transfer(1)
    transfer.advance(S.TRANSFERRING)
    assert transfer.fail("first") is True
    assert transfer.fail("second") is False
    for state in (S.PENDING, S.TRANSFERRING, S.DONE):
        with pytest.raises(InvalidTransition):
            transfer.advance(state)
    assert (transfer.state, transfer.error) == (S.FAILED, "first")


def test_done_is_terminal() -> None:
    transfer = Transfer(1)
    transfer.advance(S.DONE)
    assert transfer.fail("late") is False
    with pytest.raises(InvalidTransition):
        transfer.advance(S.DONE)
    assert (transfer.state, transfer.error) == (S.DONE, None)


def test_wait_times_out_in_a_non_terminal_state() -> None:
    transfer = Transfer(1)
    transfer.advance(S.BOOTSTRAPPING)
    assert transfer.wait(timeout=0.01) is S.BOOTSTRAPPING


@pytest.mark.parametrize("outcome", [S.DONE, S.FAILED])
def test_wait_wakes_on_another_threads_transition(outcome: TransferState) -> None:
    transfer = Transfer(1)
    waiting = threading.Event()
    seen: list[TransferState] = []

    def waiter() -> None:
        waiting.set()
        seen.append(transfer.wait(timeout=30))

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait()
    transfer.advance(S.TRANSFERRING)
    if outcome is S.DONE:
        transfer.advance(S.DONE)
    else:
        transfer.fail("boom")
    thread.join(timeout=30)
    assert seen == [outcome]


def test_concurrent_fail_and_done_have_one_winner() -> None:
    for transfer_id in range(50):
        transfer = Transfer(transfer_id)
        transfer.advance(S.TRANSFERRING)
        results: dict[str, object] = {}

        def finish() -> None:
            try:
                transfer.advance(S.DONE)
                results["done"] = True
            except InvalidTransition:
                results["done"] = False

        def fail() -> None:
            results["failed"] = transfer.fail("race")

        threads = [threading.Thread(target=finish), threading.Thread(target=fail)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results["done"] != results["failed"]
        assert transfer.state is (S.DONE if results["done"] else S.FAILED)
