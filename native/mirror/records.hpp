// The records flowcheck._mirror writes: one packet row per frame (parse), and the reassembly's stream, message,
// segment, missing-range and gap rows.  They are C structs; layouts() describes them so that Python builds matching
// numpy dtypes instead of restating the offsets.
#pragma once

#include <cstdint>

namespace mirror {

enum Status : uint8_t { OK = 0, NOT_ROCE = 1, BAD_ICRC = 2, MALFORMED = 3 };
enum Role : uint8_t { NO_ROLE, FIRST, MIDDLE, LAST, ONLY };
enum Kind : uint8_t { SEND = 0, WRITE = 1, READ = 2, ACK = 3, UD = 4, OTHER = 5, UNKNOWN = 255 };

// One row per frame; Python's PACKET dtype is built from `layouts()`.
struct PacketRow {
    int64_t payload_off;  // absolute offset of the payload in the capture buffer
    uint64_t va;
    // the u32 at payload bytes 4..8 (an NCCL LL line's flag word), -1 unless OK with a payload of >= 16 bytes: read
    // here, while the frame is in cache, so the decoder's segment flags need no second pass over the capture
    int64_t ll_flag;
    uint8_t src_ip[16], dst_ip[16];  // IPv4 as ::ffff:a.b.c.d
    uint8_t src_mac[6], dst_mac[6];
    uint32_t dqpn, psn, rkey, dma_len, imm, aeth, qkey, src_qpn;
    int32_t payload_len;
    int16_t vlan;
    uint16_t sport, pkey, bth_offset;
    uint8_t status, ip_version, opcode, pad, hop_limit, traffic_class;
    uint8_t ackreq, se, migreq, has_reth, has_imm, has_aeth, has_deth;
};

struct StreamRow {
    int64_t first_frame, last_frame, psn_first, psn_last;  // PSNs: unwrapped, of placed requests
    uint8_t src_ip[16], dst_ip[16], src_mac[6], dst_mac[6];
    uint32_t dqpn;
    int32_t n_packets, n_requests, n_writes, n_sends, n_acks, n_reads, n_ud, n_other, n_duplicates, n_messages, pmtu;
    int16_t vlan;
    uint16_t sport;
    uint8_t ip_version;
};

enum MessageFlag : uint16_t {
    START_INFERRED = 1,  // FIRST lost: the start is the previous message's end + 1
    START_UNKNOWN = 2,   // FIRST lost before any boundary: offsets count from the first packet seen
    END_INFERRED = 4,    // LAST lost: the end comes from the RETH length or the next message's start
    END_UNKNOWN = 8,     // LAST lost and nothing says where the message ends (end of capture)
    BAD_LENGTH = 16,     // payload sizes disagree with the PMTU or the RETH length
};

struct MessageRow {
    int64_t first_psn, last_psn, va, dma_len, bytes_seen, first_frame, last_frame, seg_start;
    // LL, from the parse's ll_flag of its segments (in PSN order): the first flag >= 0 (-1: none), and whether no two
    // consecutive segments with flags carry different ones (what decode's split_by_flag would cut at)
    int64_t ll_flag;
    uint8_t ll_uniform;
    int32_t stream, n_packets, n_expected, n_segs, pmtu;
    uint32_t rkey, imm;
    uint16_t flags;
    uint8_t kind, first_opcode, last_opcode, has_imm, complete;
};

struct SegmentRow {
    int64_t offset, msg_offset, frame, psn;
    int32_t message, length;
};

struct MissingRow {
    int64_t start, end;  // byte range in the message; end -1 = up to the unknown end
    int32_t message, pad_;
};

enum GapKind : uint8_t { HOLE = 0, TAIL = 1 };

struct GapRow {
    int64_t start, end;  // unwrapped PSNs, half-open
    int32_t stream;
    uint8_t kind;
    uint8_t pad_[3];  // zero (aggregate-initialised), so that equal tables are equal bytes
};


}  // namespace mirror
