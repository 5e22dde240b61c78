"""p2p.backoff.RetryBook: a key that failed is blocked for retry_after seconds; the book stays bounded."""

import threading

import pytest

from p2p.backoff import MAX_ENTRIES, RetryBook


class Clock:
    """A clock the test moves by hand (no test outcome depends on real time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_key_is_blocked_for_retry_after_then_asked_again():
    clock = Clock()
    book = RetryBook(2.0, clock=clock)
    assert not book.blocked("a")  # never failed
    book.failed("a")
    assert book.blocked("a") and not book.blocked("b")
    clock.now += 1.999
    assert book.blocked("a")
    clock.now += 0.001
    assert not book.blocked("a")  # exactly retry_after later: asked again
    book.failed("a")  # failed again: blocked afresh from now
    clock.now += 1.0
    assert book.blocked("a")


def test_success_unblocks_and_old_failures_are_forgotten():
    clock = Clock()
    book = RetryBook(1.0, clock=clock)
    book.failed("a")
    book.succeeded("a")
    assert not book.blocked("a") and len(book) == 0
    book.succeeded("never-seen")  # no error for a key the book does not hold
    book.failed("old")
    clock.now += 700.0
    book.failed("new")
    book.forget_older_than(600.0)
    assert len(book) == 1 and not book.blocked("old")


def test_tuple_keys_as_the_slice_reads_use_them():
    book = RetryBook(2.0, clock=Clock())
    book.failed((b"\x01" * 32, "peer-a"))
    assert book.blocked((b"\x01" * 32, "peer-a"))
    assert not book.blocked((b"\x01" * 32, "peer-b"))


def test_a_flood_of_made_up_keys_stays_bounded_and_drops_the_oldest_first():
    clock = Clock()
    book = RetryBook(3600.0, max_entries=100, clock=clock)
    book.failed("kept-fresh")
    for index in range(10_000):  # a peer naming ever new digests, none expired
        clock.now += 0.001
        book.failed(f"flood-{index}")
        if index == 5_000:
            book.failed("kept-fresh")  # failed again: moves to the back of the book
    assert len(book) == 100
    assert book.blocked("flood-9999") and book.blocked("flood-9900")
    assert not book.blocked("flood-0")  # dropped early: only asked again sooner
    assert not book.blocked("kept-fresh")  # 4,999 newer failures pushed it out too


def test_expired_failures_go_before_fresh_ones_when_the_book_is_full():
    clock = Clock()
    book = RetryBook(1.0, max_entries=3, clock=clock)
    book.failed("old-1")
    book.failed("old-2")
    clock.now += 5.0  # both expired
    book.failed("fresh-1")
    book.failed("fresh-2")  # one too many: the expired ones go, not a fresh one
    assert len(book) == 2
    assert book.blocked("fresh-1") and book.blocked("fresh-2")


def test_the_default_bound_holds_under_threads():
    book = RetryBook(60.0)

    def flood(prefix: str) -> None:
        for index in range(3 * MAX_ENTRIES):
            book.failed((prefix, index))
            book.blocked((prefix, index // 2))

    threads = [threading.Thread(target=flood, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(book) == MAX_ENTRIES


@pytest.mark.parametrize("retry_after, max_entries", [(-1.0, 10), (1.0, 0)])
def test_bad_settings_are_refused(retry_after, max_entries):
    with pytest.raises(ValueError, match="retry_after"):
        RetryBook(retry_after, max_entries=max_entries)
