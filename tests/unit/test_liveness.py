"""PeerClock: a silent peer is dead; our own stall is not its silence."""
from __future__ import annotations

from zpd.wire.liveness import PeerClock

TIMEOUT, BEAT = 2.0, 0.5


def tick(clock: PeerClock, now: float) -> bool:
    """What a heartbeat does: judge, then ping."""
    dead = clock.silent(now, TIMEOUT)
    clock.pinged(now)
    return dead


def test_an_answering_peer_is_never_dead():
    clock = PeerClock(0.0)
    for i in range(1, 40):
        assert not tick(clock, i * BEAT)
        clock.heard(i * BEAT + 0.001)


def test_a_peer_that_stops_answering_is_dead_within_timeout_plus_two_beats():
    clock = PeerClock(0.0)
    now, died = 0.0, 3.2
    while True:
        now += BEAT
        if tick(clock, now):
            break
        if now < died:
            clock.heard(now + 0.001)
    assert TIMEOUT < now - died <= TIMEOUT + 2 * BEAT


def test_our_own_stall_is_not_the_peers_silence():
    clock = PeerClock(0.0)
    assert not tick(clock, 0.5)
    clock.heard(0.501)                     # its pong, then we stall for 10 s
    assert not tick(clock, 10.5)           # judged before the fresh ping: not dead
    clock.heard(10.501)
    assert not tick(clock, 11.0)


def test_a_peer_that_was_dead_before_our_stall_is_found_after_it():
    clock = PeerClock(0.0)
    tick(clock, 0.5)                       # never answered
    assert tick(clock, 10.5)


def test_any_message_counts():
    clock = PeerClock(0.0)
    tick(clock, 0.5)
    clock.heard(2.4)                       # e.g. a token, not a pong
    assert not tick(clock, 3.0)
    assert clock.silence(3.0) == 3.0 - 2.4
