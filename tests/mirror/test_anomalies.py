"""Decode's records are frozen types whose ``to_json`` is the report's contract: every key, in the order
``flowcheck decode --json`` has always printed them."""
from __future__ import annotations

import dataclasses

import pytest

from flowcheck.capture.mirror.anomalies import (ChannelCount, Duplicates, LLBadFlags, LLMisalignedSegment,
                                                NoRingConnection, PsnGap, SendLost, StepSeenTwice, TrailingResend,
                                                unplaced_anomaly)
from flowcheck.capture.mirror.pipeline import StaleIteration
from flowcheck.capture.mirror.streams import StreamRole

WHERE = {"stream": "a->b qpn=0x12", "psn": [7, 9], "flag": 4, "t0": 1700000000000000123}

GOLDEN = [
    (LLMisalignedSegment.at(WHERE, bytes=24),
     [("stream", "a->b qpn=0x12"), ("psn", [7, 9]), ("flag", 4), ("t0", 1700000000000000123),
      ("type", "ll_misaligned_segment"), ("bytes", 24)]),
    (LLBadFlags.at(WHERE, lines=3),
     [("stream", "a->b qpn=0x12"), ("psn", [7, 9]), ("flag", 4), ("t0", 1700000000000000123), ("type", "ll_bad_flags"),
      ("lines", 3)]),
    (StepSeenTwice.at(WHERE),
     [("stream", "a->b qpn=0x12"), ("psn", [7, 9]), ("flag", 4), ("t0", 1700000000000000123),
      ("type", "step_seen_twice")]),
    (SendLost("a->b qpn=0x12", 5), [("type", "send_lost"), ("stream", "a->b qpn=0x12"), ("step", 5)]),
    (ChannelCount("0->1", 1, 2), [("type", "channel_count"), ("link", "0->1"), ("data_connections", 1), ("channels", 2)]),
    (NoRingConnection(),
     [("type", "no_ring_connection"), ("detail", "no stream between ring neighbours of the job carries NCCL sends; "
                                                 "check the ring members' MAC/IP addresses and the protocol")]),
    (PsnGap("a->b qpn=0x12", (62, 77), 15),
     [("type", "psn_gap"), ("stream", "a->b qpn=0x12"), ("psn", [62, 77]), ("packets", 15)]),
    (Duplicates("a->b qpn=0x12", 3), [("type", "duplicates"), ("stream", "a->b qpn=0x12"), ("packets", 3)]),
    (TrailingResend("a->b qpn=0x12", 7, 1, 3, (0, 2048)),
     [("type", "trailing_resend"), ("stream", "a->b qpn=0x12"), ("step", 7), ("resend_of", 1), ("allreduce_step", 3),
      ("range", [0, 2048]),
      ("detail", "trailing re-send of step 3 of allreduce 1 ignored (final values of elements [0, 2048) again)")]),
    (StreamRole("a->b qpn=0x12", "ring", 40), [("stream", "a->b qpn=0x12"), ("role", "ring"), ("messages", 40)]),
    (StaleIteration(3, 13, "allreduce 4 incomplete"),
     [("iteration", 3), ("step", 13), ("reason", "allreduce 4 incomplete")]),
]


@pytest.mark.parametrize("record,items", GOLDEN, ids=lambda v: type(v).__name__ if not isinstance(v, list) else "")
def test_to_json_is_the_report_s_dict_key_for_key_in_order(record, items):
    assert list(record.to_json().items()) == items
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, dataclasses.fields(record)[0].name, None)
    assert record == dataclasses.replace(record) and hash(record) == hash(dataclasses.replace(record))


def test_each_anomaly_says_which_send_step_it_is_about_and_whether_it_is_packet_level():
    assert [a.send_step for a, _ in GOLDEN[:5]] == [4, 4, 4, 5, None]
    assert TrailingResend("s", 7, 1, 3, (0, 1)).send_step == 7 and NoRingConnection().send_step is None
    assert [a.packet_level for a, _ in GOLDEN[:9]] == [False] * 6 + [True, True, False]


def test_an_unplaced_segment_is_misaligned_when_its_status_is_negative_else_bad_flags():
    assert unplaced_anomaly(WHERE, -1, 24) == LLMisalignedSegment.at(WHERE, bytes=24)
    assert unplaced_anomaly(WHERE, 3, 48) == LLBadFlags.at(WHERE, lines=3)
