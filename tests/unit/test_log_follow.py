"""Log wake-ups cross replicas only while another replica follows the pod
(``wakeups.Wakeups(followed_only=True)``); time from a controlled clock."""

from __future__ import annotations

from gpucloud.services import wakeups
from gpucloud.services.wakeups import ANNOUNCE_SECONDS, INTEREST_SECONDS, PRUNE_AT, Wakeups


class Clock:
    def __init__(self) -> None:
        self.at = 1000.0

    def __call__(self) -> float:
        return self.at


def _hub(followed_only: bool = True) -> tuple[Wakeups, Clock, list[str], list[str]]:
    clock, published, announced = Clock(), list[str](), list[str]()
    hub = Wakeups(followed_only=followed_only, now=clock)
    hub.publisher, hub.announcer = published.append, announced.append
    return hub, clock, published, announced


def test_a_chunk_is_published_only_while_another_replica_follows_its_pod() -> None:
    hub, clock, published, _ = _hub()
    hub.notify("pod-1")
    assert published == []
    hub.followed_elsewhere("pod-1")
    hub.notify("pod-1")
    hub.notify("pod-2")
    assert published == ["pod-1"]
    clock.at += INTEREST_SECONDS - 1
    hub.notify("pod-1")
    assert published == ["pod-1"] * 2
    clock.at += 1  # no announcement since: the follower is gone, or will say so again
    hub.notify("pod-1")
    assert published == ["pod-1"] * 2 and not hub.followed("pod-1")


def test_other_wakeups_are_published_always() -> None:
    hub, _, published, _ = _hub(followed_only=False)
    hub.notify("node-1")
    assert published == ["node-1"]
    assert not wakeups.ASSIGNMENTS._followed_only and wakeups.LOGS._followed_only


def test_a_follow_is_announced_at_most_every_announce_seconds() -> None:
    hub, clock, _, announced = _hub()
    assert hub.follow("pod-1") and not hub.follow("pod-1")
    assert hub.follow("pod-2")
    clock.at += ANNOUNCE_SECONDS - 1
    assert not hub.follow("pod-1")
    clock.at += 1
    assert hub.follow("pod-1")
    assert announced == ["pod-1", "pod-2", "pod-1"]
    hub.announce_again()  # a replica joined: it hears of every follow at its next turn
    assert hub.follow("pod-1") and hub.follow("pod-2")
    assert INTEREST_SECONDS > ANNOUNCE_SECONDS + 30  # a 30 s wait outlives no announcement


def test_without_a_bridge_nothing_is_announced() -> None:
    hub = Wakeups(followed_only=True)
    assert not hub.follow("pod-1")


def test_the_remembered_follows_stay_bounded() -> None:
    hub, clock, _, _ = _hub()
    for i in range(PRUNE_AT * 3):
        hub.followed_elsewhere(f"pod-{i}")
        hub.follow(f"pod-{i}")
        clock.at += INTEREST_SECONDS / PRUNE_AT
    assert len(hub._followed) <= 2 * PRUNE_AT and len(hub._announced) <= 2 * PRUNE_AT
    assert hub.followed(f"pod-{PRUNE_AT * 3 - 1}")
