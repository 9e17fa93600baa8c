// RoCEv2 parsing, the part the reassembly shares: the opcode table, the capture's frames with the packet table they
// parse into, and parse_frames, which hands each row on while it is in cache (parse_reassemble demultiplexes there).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "bytes.hpp"
#include "records.hpp"

namespace mirror {

struct OpInfo {
    Kind kind = UNKNOWN;
    Role role = NO_ROLE;
    bool reth = false, deth = false, aeth = false, imm = false, payload = true;
};

struct OpTable {
    OpInfo op[256];
    OpTable() {
        const Role roles[6] = {FIRST, MIDDLE, LAST, LAST, ONLY, ONLY};
        for (int i = 0; i < 6; ++i) {  // RC SEND 0-5 and WRITE 6-11 share the FIRST..ONLY_IMM pattern
            op[i] = {SEND, roles[i], false, false, false, i == 3 || i == 5, true};
            op[6 + i] = {WRITE, roles[i], i == 0 || i >= 4, false, false, i == 3 || i == 5, true};
        }
        op[12] = {READ, NO_ROLE, true, false, false, false, false};  // READ_REQUEST
        op[13] = {READ, FIRST, false, false, true, false, true};
        op[14] = {READ, MIDDLE, false, false, false, false, true};
        op[15] = {READ, LAST, false, false, true, false, true};
        op[16] = {READ, ONLY, false, false, true, false, true};
        op[17] = {ACK, NO_ROLE, false, false, true, false, false};
        op[0x64] = {UD, ONLY, false, true, false, false, true};
        op[0x65] = {UD, ONLY, false, true, false, true, true};
        op[0x81] = {OTHER, NO_ROLE, false, false, false, false, true};  // CNP: 16 reserved bytes
    }
};
extern const OpTable ops;

struct L3 {
    size_t ip, ip_len, udp;  // offsets in the frame; ip_len = IP header length
    bool v6;
};

// The stages of parse_frame (parse.cpp).  parse_frame itself is inline so that parse_frames inlines it in every pass,
// as in parse_reassemble's (reassembly.cpp).
bool parse_l2(const uint8_t* f, size_t n, PacketRow& r, size_t& l3, uint16_t& type);
Status parse_ip_udp(const uint8_t* f, size_t n, size_t ip, uint16_t type, PacketRow& r, L3& l3);
Status parse_bth(const uint8_t* f, const L3& l3, PacketRow& r, bool check_icrc);

// One frame into its row (zeroed by the caller, vlan -1): its status.
inline Status parse_frame(const uint8_t* f, size_t n, PacketRow& r, bool check_icrc) {
    size_t ip;
    uint16_t type;
    L3 l3{};
    if (!parse_l2(f, n, r, ip, type)) return MALFORMED;
    Status s = parse_ip_udp(f, n, ip, type, r, l3);
    return s == OK ? parse_bth(f, l3, r, check_icrc) : s;
}

// A pass that reads whole frames in capture order (the ICRC check) fetches this many frames ahead, every line of them:
// with the hardware prefetcher alone the checking parse waited on memory about as long as it computed (bench_mirror
// (a): parse with ICRC -26%, 6 frames ahead as good as 3 or 12).
constexpr size_t PREFETCH_FRAMES = 6;

inline void prefetch_frame(const uint8_t* f, int32_t n) {
    for (int32_t k = 0; k < n; k += 64) __builtin_prefetch(f + k);
}

constexpr size_t N_COUNTS = 4 + 256;  // frames per Status (4), then frames with a BTH per opcode (256)

// A capture's frames, checked to lie inside its buffer, and the packet table they parse into.
struct FrameTable {
    const uint8_t* buf;
    const int64_t* offsets;
    const int32_t* lengths;
    PacketRow* rows;
    size_t n;
};

// Parses frames [lo, hi) into their rows, adding to the counts (N_COUNTS), and hands each row to on_row(row, i) right
// after parsing it, while it is in cache.
template <class OnRow>
void parse_frames(const FrameTable& t, size_t lo, size_t hi, bool check_icrc, int64_t* cnt, OnRow&& on_row) {
    const uint8_t* buf = t.buf;
    const int64_t* o = t.offsets;
    const int32_t* l = t.lengths;
    PacketRow* r = t.rows;
    for (size_t i = lo; i < hi; ++i) {
        if (check_icrc && i + PREFETCH_FRAMES < hi) prefetch_frame(buf + o[i + PREFETCH_FRAMES], l[i + PREFETCH_FRAMES]);
        else if (i + 4 < hi) __builtin_prefetch(buf + o[i + 4]), __builtin_prefetch(buf + o[i + 4] + 64);  // headers
        std::memset(&r[i], 0, sizeof(PacketRow));
        r[i].vlan = -1;
        r[i].status = parse_frame(buf + o[i], size_t(l[i]), r[i], check_icrc);
        if (r[i].status == OK) r[i].payload_off += o[i];
        else r[i].payload_off = -1, r[i].payload_len = 0;
        r[i].ll_flag = r[i].payload_len >= 16 ? int64_t(le32(buf + r[i].payload_off + 4)) : -1;
        ++cnt[r[i].status];
        if (r[i].bth_offset) ++cnt[4 + r[i].opcode];
        on_row(r[i], i);
    }
}

// The frames of a capture buffer, each checked to lie inside it, and the packet table `out` (one row per frame).
FrameTable frame_table(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out);

}  // namespace mirror
