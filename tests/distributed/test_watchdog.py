"""The watchdog's protocol over socket pairs, in one process (no runtime started).

Process 0 watches one connection per other process; the others watch theirs to
process 0. The runs over real processes and hosts are in
tests/jobs/test_multihost_faults.py.
"""

import socket
import threading

from jaxrec.distributed import watchdog


def _calls():
    calls, done = [], threading.Event()

    def on_lost(process, address, how):
        calls.append((process, how))
        done.set()

    return calls, done, on_lost


def _run(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def test_process_0_names_the_first_lost_process_to_the_others():
    (a, a_peer), (b, b_peer), (c, c_peer) = (socket.socketpair() for _ in range(3))
    calls, done, on_lost = _calls()
    t = _run(watchdog._watch_others, {1: a, 2: b, 3: c}, threading.Event(), on_lost)
    a_peer.sendall(b"DONE\n")  # process 1 finished normally: not a loss
    a_peer.close()
    c_peer.close()  # process 3 died
    assert done.wait(10) and calls == [(3, "stopped responding")]
    assert b_peer.recv(64) == b"LOST 3 False\n"  # process 2 hears which one
    t.join(10)
    assert not t.is_alive()
    b_peer.close()


def test_a_process_that_failed_is_reported_as_failed():
    (a, a_peer), (b, b_peer) = socket.socketpair(), socket.socketpair()
    calls, done, on_lost = _calls()
    _run(watchdog._watch_others, {1: a, 2: b}, threading.Event(), on_lost)
    b_peer.sendall(b"FAIL\n")
    assert done.wait(10) and calls == [(2, "failed with an error")]
    assert a_peer.recv(64) == b"LOST 2 True\n"
    a_peer.close()
    b_peer.close()


def test_the_others_hear_of_a_loss_or_lose_process_0():
    for sent, want in [
        (b"LOST 2 False\n", [(2, "stopped responding")]),
        (b"LOST 1 True\n", [(1, "failed with an error")]),
        (b"FAIL\n", [(0, "failed with an error")]),
        (b"", [(0, "stopped responding")]),  # process 0 died: its connection closed
        (b"DONE\n", []),  # process 0 finished normally
    ]:
        conn, peer = socket.socketpair()
        calls, _, on_lost = _calls()
        t = _run(watchdog._watch_first, conn, threading.Event(), on_lost)
        peer.sendall(sent)
        peer.close()
        t.join(10)
        assert not t.is_alive() and calls == want, sent


def test_a_stopped_watchdog_reports_nothing():
    conn, peer = socket.socketpair()
    stopped = threading.Event()
    calls, _, on_lost = _calls()
    t = _run(watchdog._watch_first, conn, stopped, on_lost)
    stopped.set()  # this process ends: process 0 closing then is no loss
    peer.close()
    t.join(10)
    assert not t.is_alive() and calls == []
