// The record layouts for Python: every field of the records in records.hpp with its numpy format and offset, so the
// capture modules build matching dtypes instead of restating the offsets.
#include <cstddef>

#include "api.hpp"
#include "bytes.hpp"
#include "records.hpp"

#define FIELD(T, name, fmt) py::make_tuple(#name, fmt, offsetof(T, name))

namespace mirror {

namespace {

py::tuple layout(py::list fields, size_t itemsize) { return py::make_tuple(fields, itemsize); }

}  // namespace

py::dict layouts() {
    py::dict d;
    d["packet"] = layout(
        py::list(py::make_tuple(
            FIELD(PacketRow, payload_off, "<i8"), FIELD(PacketRow, va, "<u8"), FIELD(PacketRow, ll_flag, "<i8"),
            FIELD(PacketRow, src_ip, "(16,)u1"),
            FIELD(PacketRow, dst_ip, "(16,)u1"), FIELD(PacketRow, src_mac, "(6,)u1"), FIELD(PacketRow, dst_mac, "(6,)u1"),
            FIELD(PacketRow, dqpn, "<u4"), FIELD(PacketRow, psn, "<u4"), FIELD(PacketRow, rkey, "<u4"),
            FIELD(PacketRow, dma_len, "<u4"), FIELD(PacketRow, imm, "<u4"), FIELD(PacketRow, aeth, "<u4"),
            FIELD(PacketRow, qkey, "<u4"), FIELD(PacketRow, src_qpn, "<u4"), FIELD(PacketRow, payload_len, "<i4"),
            FIELD(PacketRow, vlan, "<i2"), FIELD(PacketRow, sport, "<u2"), FIELD(PacketRow, pkey, "<u2"),
            FIELD(PacketRow, bth_offset, "<u2"), FIELD(PacketRow, status, "u1"), FIELD(PacketRow, ip_version, "u1"),
            FIELD(PacketRow, opcode, "u1"), FIELD(PacketRow, pad, "u1"), FIELD(PacketRow, hop_limit, "u1"),
            FIELD(PacketRow, traffic_class, "u1"), FIELD(PacketRow, ackreq, "?"), FIELD(PacketRow, se, "?"),
            FIELD(PacketRow, migreq, "?"), FIELD(PacketRow, has_reth, "?"), FIELD(PacketRow, has_imm, "?"),
            FIELD(PacketRow, has_aeth, "?"), FIELD(PacketRow, has_deth, "?"))),
        sizeof(PacketRow));
    d["stream"] = layout(
        py::list(py::make_tuple(
            FIELD(StreamRow, first_frame, "<i8"), FIELD(StreamRow, last_frame, "<i8"), FIELD(StreamRow, psn_first, "<i8"),
            FIELD(StreamRow, psn_last, "<i8"), FIELD(StreamRow, src_ip, "(16,)u1"), FIELD(StreamRow, dst_ip, "(16,)u1"),
            FIELD(StreamRow, src_mac, "(6,)u1"), FIELD(StreamRow, dst_mac, "(6,)u1"), FIELD(StreamRow, dqpn, "<u4"),
            FIELD(StreamRow, n_packets, "<i4"), FIELD(StreamRow, n_requests, "<i4"), FIELD(StreamRow, n_writes, "<i4"),
            FIELD(StreamRow, n_sends, "<i4"), FIELD(StreamRow, n_acks, "<i4"), FIELD(StreamRow, n_reads, "<i4"),
            FIELD(StreamRow, n_ud, "<i4"), FIELD(StreamRow, n_other, "<i4"), FIELD(StreamRow, n_duplicates, "<i4"),
            FIELD(StreamRow, n_messages, "<i4"), FIELD(StreamRow, pmtu, "<i4"), FIELD(StreamRow, vlan, "<i2"),
            FIELD(StreamRow, sport, "<u2"), FIELD(StreamRow, ip_version, "u1"))),
        sizeof(StreamRow));
    d["message"] = layout(
        py::list(py::make_tuple(
            FIELD(MessageRow, first_psn, "<i8"), FIELD(MessageRow, last_psn, "<i8"), FIELD(MessageRow, va, "<i8"),
            FIELD(MessageRow, dma_len, "<i8"), FIELD(MessageRow, bytes_seen, "<i8"), FIELD(MessageRow, first_frame, "<i8"),
            FIELD(MessageRow, last_frame, "<i8"), FIELD(MessageRow, seg_start, "<i8"), FIELD(MessageRow, ll_flag, "<i8"),
            FIELD(MessageRow, ll_uniform, "?"), FIELD(MessageRow, stream, "<i4"),
            FIELD(MessageRow, n_packets, "<i4"), FIELD(MessageRow, n_expected, "<i4"), FIELD(MessageRow, n_segs, "<i4"),
            FIELD(MessageRow, pmtu, "<i4"), FIELD(MessageRow, rkey, "<u4"), FIELD(MessageRow, imm, "<u4"),
            FIELD(MessageRow, flags, "<u2"), FIELD(MessageRow, kind, "u1"), FIELD(MessageRow, first_opcode, "u1"),
            FIELD(MessageRow, last_opcode, "u1"), FIELD(MessageRow, has_imm, "?"), FIELD(MessageRow, complete, "?"))),
        sizeof(MessageRow));
    d["segment"] = layout(py::list(py::make_tuple(FIELD(SegmentRow, offset, "<i8"), FIELD(SegmentRow, msg_offset, "<i8"),
                                                  FIELD(SegmentRow, frame, "<i8"), FIELD(SegmentRow, psn, "<i8"),
                                                  FIELD(SegmentRow, message, "<i4"), FIELD(SegmentRow, length, "<i4"))),
                          sizeof(SegmentRow));
    d["missing"] = layout(py::list(py::make_tuple(FIELD(MissingRow, start, "<i8"), FIELD(MissingRow, end, "<i8"),
                                                  FIELD(MissingRow, message, "<i4"))),
                          sizeof(MissingRow));
    d["gap"] = layout(py::list(py::make_tuple(FIELD(GapRow, start, "<i8"), FIELD(GapRow, end, "<i8"),
                                              FIELD(GapRow, stream, "<i4"), FIELD(GapRow, kind, "u1"))),
                      sizeof(GapRow));
    return d;
}

}  // namespace mirror
