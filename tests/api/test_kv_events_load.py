"""The EngineLoad the KV-event stream pushes: what the SMG gateway reads to tell a long prefill from a wedged
engine (engine_silence_ms, engine_reports_steps, prefill_pending_tokens; smg-grpc-proto common.proto).

Run: python -m pytest -q tests/api/test_kv_events_load.py
"""

import asyncio
import time
from types import SimpleNamespace

from serving.api.kv_events import KvEventPublisher


class FakeRequest(SimpleNamespace):
    pass


def fake_engine(requests):
    running = sum(1 for r in requests if r.num_output)
    return SimpleNamespace(
        requests={f"r{i}": r for i, r in enumerate(requests)}, kv=SimpleNamespace(use_prefix_cache=False),
        ecfg=SimpleNamespace(max_running=8),
        stats=lambda: {"running": running, "waiting": len(requests) - running, "kv_usage": 0.25})


def test_load_reports_pending_prefill_and_silence_while_requests_wait():
    reqs = [FakeRequest(num_prompt=300, num_output=0, is_finished=False),   # prefilling: counts
            FakeRequest(num_prompt=41, num_output=0, is_finished=False),    # queued: counts
            FakeRequest(num_prompt=77, num_output=5, is_finished=False),    # decoding: does not
            FakeRequest(num_prompt=13, num_output=0, is_finished=True)]     # finished: does not
    pub = KvEventPublisher(page_size=16)
    engine = fake_engine(reqs)
    pub.on_step(engine, [object()])           # a step with output
    pub._load_time = 0.0                      # let the next step refresh the load record
    pub.on_step(engine, [])                   # a silent step (a long prefill chunk)
    time.sleep(0.12)
    load = pub._heartbeat_load()
    assert load.prefill_pending_tokens == 341 and load.HasField("engine_reports_steps") and not load.engine_reports_steps
    assert load.load_only and load.running_requests == 1 and load.waiting_requests == 3
    assert 100 <= load.engine_silence_ms < 5000


def test_idle_engine_reports_no_silence():
    pub = KvEventPublisher(page_size=16)
    pub.on_step(fake_engine([]), [])
    pub._load_time = 0.0
    pub.on_step(fake_engine([]), [])
    load = pub._heartbeat_load()
    assert not load.HasField("engine_silence_ms") and load.prefill_pending_tokens == 0


def test_heartbeat_on_the_subscription_carries_the_silence():
    pub = KvEventPublisher(page_size=16)
    engine = fake_engine([FakeRequest(num_prompt=500, num_output=0, is_finished=False)])
    pub._load_time = 0.0
    pub.on_step(engine, [])

    async def first_heartbeat():
        import serving.api.kv_events as kv_events

        kv_events.HEARTBEAT_S, saved = 0.05, kv_events.HEARTBEAT_S
        try:
            stream = pub.subscribe(0)
            batches = [await stream.__anext__(), await stream.__anext__()]  # the snapshot, then a heartbeat
            await stream.aclose()
            return batches
        finally:
            kv_events.HEARTBEAT_S = saved

    snapshot, beat = asyncio.run(first_heartbeat())
    assert beat.load.load_only and beat.load.prefill_pending_tokens == 500 and beat.load.engine_silence_ms >= 0


def test_heartbeat_reports_the_prefill_in_hand_not_the_last_steps_record():
    """A request that arrives while the engine thread is inside a long step is in no step's load record yet;
    with `in_hand` the beat still reports its prompt and the engine's silence (and none once nothing is live)."""
    in_hand = [(0, 0)]
    pub = KvEventPublisher(page_size=16, in_hand=lambda: in_hand[0])
    pub._load_time = 0.0
    pub.on_step(fake_engine([]), [])  # the last step saw an idle engine
    in_hand[0] = (2, 733)
    time.sleep(0.06)
    load = pub._heartbeat_load()
    assert load.prefill_pending_tokens == 733 and 50 <= load.engine_silence_ms < 5000
    in_hand[0] = (0, 0)
    pub._load_time = 0.0
    pub.on_step(fake_engine([FakeRequest(num_prompt=90, num_output=0, is_finished=False)]), [])  # a stale busy record
    load = pub._heartbeat_load()
    assert load.prefill_pending_tokens == 0 and not load.HasField("engine_silence_ms")


def test_step_records_take_pending_prefill_from_in_hand_when_given():
    """Event batches and heartbeats share one definition of the pending prefill: with `in_hand`, the step's load
    record reads it too (here deliberately unlike the engine's own requests, so the source is visible)."""
    engine = fake_engine([FakeRequest(num_prompt=90, num_output=0, is_finished=False)])
    pub = KvEventPublisher(page_size=16, in_hand=lambda: (1, 417))
    pub._load_time = 0.0
    pub.on_step(engine, [])
    assert pub._load.prefill_pending_tokens == 417
    plain = KvEventPublisher(page_size=16)
    plain._load_time = 0.0
    plain.on_step(engine, [])
    assert plain._load.prefill_pending_tokens == 90
