"""Chaos under steady load: kill or pause one part at a time and see what clients see.

The fleet (tests/chaos/harness.py): 3 simulated workers with their KV-event bridges, 2 `kvgate
serve` replicas sharing a private Redis, Envoy with both replicas in its ext_proc cluster.
Clients send multi-turn chats at a steady pace the whole time. For each fault the table says
how many requests failed, whether the failures were only those in flight on the faulted worker,
how long until requests were routed by cache again, and whether a dead node's entries were used
after they should have expired.

Goals asserted:
- a kvgate replica, Redis or a bridge failing costs clients nothing (kvgate fails open);
- a killed or paused worker costs only the requests already on it (or sent to it before its
  failure could be seen: ~the ZMQ disconnect for kill -9, the engine timeout for a pause);
- routing by cache comes back within seconds of the part returning;
- no request is routed by kvgate to a dead node after its liveness deadline.

`make test` runs the replica and worker kills (marked ``chaos_short``); `make chaos` runs all.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from tests.chaos.conftest import ROWS
from tests.chaos.harness import ENGINE_TIMEOUT_S, HEALTH_INTERVAL_MS, TTL_S, ChaosFleet, Worker
from tests.chaos.load import Row, Sample, SteadyLoad, between, by_cache_ratio, join_access_log, resumed_after
from tests.support.http import eventually, request

WARM_S = 3.0
RESUME_BOUND_S = 6.0  # cache routing must be back this soon after the part returns
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def load(fleet: ChaosFleet):
    eventually(fleet.all_live, timeout_s=30, show=fleet.live_counts)  # the previous test restored its part
    ld = SteadyLoad(fleet.listen_port).start()
    time.sleep(WARM_S)
    yield ld
    ld.stop()


def finish(fleet: ChaosFleet, load: SteadyLoad) -> list[Sample]:
    samples = load.stop()
    answered = {s.id for s in samples if s.status}
    # Envoy's file access log is flushed every few seconds: wait until it has every answer
    def complete() -> dict[str, dict] | None:
        records = fleet.access_records()
        return records if answered <= records.keys() else None

    records = eventually(complete, timeout_s=15)
    join_access_log(samples, records)
    return samples


def row(event: str, samples: list[Sample], t0: float, t1: float, *, before: list[Sample], resumed_from: float | None = None, target: str = "") -> Row:
    window = between(samples, t0, t1)
    r = Row(
        event,
        requests=len(window),
        failed=sum(not s.ok for s in window),
        retried=sum(s.attempts > 1 for s in window),
        by_cache_before=by_cache_ratio(before),
        by_cache_after=by_cache_ratio(window),
    )
    if resumed_from is not None:
        r.resumed_s = resumed_after(window, resumed_from, target=target)
    ROWS.append(r)
    return r


def failures_on(worker: Worker, samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if not s.ok and (s.upstream == worker.address or s.dest == worker.address)]


def stale_uses(worker: Worker, samples: list[Sample], t0: float, t1: float) -> list[Sample]:
    """Requests kvgate routed to ``worker`` that started in [t0, t1)."""
    return [s for s in between(samples, t0, t1) if s.dest == worker.address]


@pytest.mark.chaos_short
def test_kill_and_restart_a_kvgate_replica(fleet: ChaosFleet, load: SteadyLoad) -> None:
    """kill -9 one of two replicas: its streams fail open, Envoy stops choosing it within a health
    check; clients see no error. Restarted, it takes decisions again."""
    doomed = fleet.replicas[1]
    t_kill = time.monotonic()
    assert doomed.proc is not None
    doomed.proc.kill(signal.SIGKILL)
    time.sleep(4.0)
    t_restart = time.monotonic()
    fleet.start_replica(doomed)
    time.sleep(4.0)
    samples = finish(fleet, load)

    killed = row(f"kill -9 kvgate replica {doomed.name}", samples, t_kill, t_restart,
                 before=between(samples, t_kill - WARM_S, t_kill), resumed_from=t_kill)  # fmt: skip
    restarted = row(f"restart kvgate replica {doomed.name}", samples, t_restart, time.monotonic(),
                    before=between(samples, t_kill, t_restart), resumed_from=t_restart)  # fmt: skip
    assert killed.failed == 0 and restarted.failed == 0, [s for s in samples if not s.ok][:5]
    assert killed.resumed_s is not None and killed.resumed_s < RESUME_BOUND_S, killed
    assert restarted.resumed_s is not None and restarted.resumed_s < RESUME_BOUND_S, restarted
    # the restarted replica decides again (Envoy's health check put it back in the rotation)
    _, _, metrics = request(f"http://127.0.0.1:{doomed.admin_port}/metrics")
    routed = [ln for ln in metrics.decode().splitlines() if ln.startswith("kvgate_decisions_total") and "fail_open" not in ln]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in routed) > 0, routed


@pytest.mark.chaos_short
def test_kill_and_restart_a_worker(fleet: ChaosFleet, load: SteadyLoad) -> None:
    """kill -9 a worker: only requests on it (or sent before its KV-event connection dropped)
    fail; kvgate stops choosing it at once (the bridge deregisters it on disconnect); restarted,
    it gets conversations again and serves them from its cache."""
    doomed = fleet.workers[2]
    assert doomed.proc is not None
    t_kill = time.monotonic()
    doomed.proc.kill(signal.SIGKILL)
    time.sleep(5.0)
    t_restart = time.monotonic()
    fleet.start_worker(doomed)
    eventually(fleet.all_live, timeout_s=20, show=fleet.live_counts)
    time.sleep(5.0)
    samples = finish(fleet, load)

    killed = row(f"kill -9 worker {doomed.name}", samples, t_kill, t_restart,
                 before=between(samples, t_kill - WARM_S, t_kill), resumed_from=t_kill)  # fmt: skip
    lost = failures_on(doomed, between(samples, t_kill - 5, t_restart))
    killed.failed_on_target = len(lost)
    killed.failed = sum(not s.ok for s in between(samples, t_kill - 5, t_restart))  # those in flight at the kill too
    stale = stale_uses(doomed, samples, t_kill + TTL_S, t_restart)
    killed.stale_after_ttl = len(stale)
    late = [s for s in lost if s.start > t_kill + 1.0]
    killed.notes.append(
        f"{sum(s.start < t_kill for s in lost)} in flight at the kill, {sum(s.start >= t_kill for s in lost)} sent after it "
        f"(last {max((s.start - t_kill for s in lost), default=0):.2f} s after)"
    )
    restarted = row(f"restart worker {doomed.name}", samples, t_restart, time.monotonic(),
                    before=between(samples, t_kill, t_restart), resumed_from=t_restart, target=doomed.name)  # fmt: skip
    failed_elsewhere = [s for s in between(samples, t_kill - 5, time.monotonic()) if not s.ok and s not in lost]
    assert not failed_elsewhere, failed_elsewhere[:5]
    assert not late, late[:5]  # after a second nothing more is sent to the dead worker
    assert not stale, stale[:5]
    assert restarted.failed == 0
    assert killed.resumed_s is not None and killed.resumed_s < RESUME_BOUND_S, killed
    assert restarted.resumed_s is not None and restarted.resumed_s < 2 * RESUME_BOUND_S, restarted


@pytest.mark.chaos
def test_stop_and_restart_redis(fleet: ChaosFleet, load: SteadyLoad) -> None:
    """Redis killed: every replica fails open (requests still served, by least-request); Redis
    back empty: the bridges re-register their nodes and rewrite their entries, routing by
    cache resumes."""
    t_stop = time.monotonic()
    fleet.redis.kill()
    time.sleep(3.0)
    t_start = time.monotonic()
    fleet.redis.start()
    time.sleep(7.0)
    samples = finish(fleet, load)

    stopped = row("stop Redis", samples, t_stop, t_start, before=between(samples, t_stop - WARM_S, t_stop))
    restarted = row("restart Redis (empty)", samples, t_start, time.monotonic(),
                    before=between(samples, t_stop, t_start), resumed_from=t_start)  # fmt: skip
    assert stopped.failed == 0 and restarted.failed == 0, [s for s in samples if not s.ok][:5]
    assert stopped.by_cache_after < 0.5 * max(stopped.by_cache_before, 0.01) or stopped.requests < 4  # it really was down
    assert restarted.resumed_s is not None and restarted.resumed_s < RESUME_BOUND_S, restarted


@pytest.mark.chaos
def test_kill_and_restart_a_bridge(fleet: ChaosFleet, load: SteadyLoad) -> None:
    """kill -9 a worker's bridge: its writer lease lapses and the replicas' keepers clear its
    entries, which nothing keeps true any more (the node, still healthy, is routed by load alone;
    nothing fails); restarted, it replays the engine's events and the node is routed by cache
    again."""
    w = fleet.workers[1]
    assert w.bridge is not None
    blocks = f"{fleet.key_prefix}:{{{w.name}}}:blocks"
    with redis.Redis(port=fleet.redis.port) as r:
        assert r.hlen(blocks) > 0
        t_kill = time.monotonic()
        w.bridge.kill(signal.SIGKILL)
        time.sleep(TTL_S + 3.0)
        left = r.hlen(blocks)  # lease 2/3 of the TTL, then a keeper's tick (TTL/3)
    t_restart = time.monotonic()
    fleet.start_bridge(w)
    eventually(fleet.all_live, timeout_s=20, show=fleet.live_counts)
    time.sleep(5.0)
    samples = finish(fleet, load)

    killed = row(f"kill -9 bridge of {w.name}", samples, t_kill, t_restart, before=between(samples, t_kill - WARM_S, t_kill))
    killed.notes.append(f"{left} entries of {w.name} left {TTL_S + 3.0:.0f} s after its bridge died")
    restarted = row(f"restart bridge of {w.name}", samples, t_restart, time.monotonic(),
                    before=between(samples, t_kill, t_restart), resumed_from=t_restart, target=w.name)  # fmt: skip
    assert killed.failed == 0 and restarted.failed == 0, [s for s in samples if not s.ok][:5]
    assert left == 0
    assert restarted.resumed_s is not None and restarted.resumed_s < 2 * RESUME_BOUND_S, restarted


@pytest.mark.chaos
def test_pause_and_resume_a_worker(fleet: ChaosFleet, load: SteadyLoad) -> None:
    """SIGSTOP a worker: requests on it time out (Envoy's route timeout); its bridge sees ZMTP
    heartbeats go unanswered and deregisters it, Envoy's health check drops it from the fallback
    cluster; nothing else fails. SIGCONT: it is followed again and gets traffic by cache."""
    w = fleet.workers[0]
    assert w.proc is not None
    t_stop = time.monotonic()
    w.proc.popen.send_signal(signal.SIGSTOP)
    time.sleep(5.0)
    t_cont = time.monotonic()
    w.proc.popen.send_signal(signal.SIGCONT)
    eventually(fleet.all_live, timeout_s=20, show=fleet.live_counts)
    time.sleep(5.0)
    samples = finish(fleet, load)

    paused = row(f"SIGSTOP worker {w.name}", samples, t_stop, t_cont, before=between(samples, t_stop - WARM_S, t_stop), resumed_from=t_stop)
    lost = failures_on(w, between(samples, t_stop - 5, t_cont))
    paused.failed_on_target = len(lost)
    paused.failed = sum(not s.ok for s in between(samples, t_stop - 5, t_cont))  # those in flight at SIGSTOP too
    detect_s = ENGINE_TIMEOUT_S + 2 * HEALTH_INTERVAL_MS / 1000 + 0.5
    stale = stale_uses(w, samples, t_stop + ENGINE_TIMEOUT_S + 0.5, t_cont)
    paused.stale_after_ttl = len(stale)
    late = [s for s in lost if s.start > t_stop + detect_s]
    paused.notes.append(f"{len(lost)} timed out on the paused worker, the last sent {max((s.start - t_stop for s in lost), default=0):.2f} s after SIGSTOP")
    resumed = row(f"SIGCONT worker {w.name}", samples, t_cont, time.monotonic(),
                  before=between(samples, t_stop, t_cont), resumed_from=t_cont, target=w.name)  # fmt: skip
    failed_elsewhere = [s for s in between(samples, t_stop - 5, time.monotonic()) if not s.ok and s not in lost]
    assert not failed_elsewhere, failed_elsewhere[:5]
    assert not late, late[:5]
    assert not stale, stale[:5]
    assert paused.resumed_s is not None and paused.resumed_s < RESUME_BOUND_S, paused
    assert resumed.resumed_s is not None and resumed.resumed_s < 2 * RESUME_BOUND_S, resumed
