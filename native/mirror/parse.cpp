// RoCEv2 parsing: Ethernet (VLAN tags), IPv4/IPv6, UDP to 4791, the BTH and its extension headers, the ICRC; one
// packet row per frame.
#include <algorithm>
#include <string>

#include "api.hpp"
#include "bytes.hpp"
#include "crc.hpp"
#include "parse.hpp"

namespace mirror {

const OpTable ops;

namespace {

// The RoCEv2 ICRC: CRC32 over 8 bytes of 0xFF (the masked LRH), the IP header with its variant
// fields (IPv4 TOS/TTL/checksum, IPv6 class/flow label/hop limit) set to ones, the UDP header
// with checksum ones, the BTH with its reserved byte 4 (FECN/BECN) ones, and the rest up to the
// ICRC.  Stored little-endian (the Linux rxe driver's order; checked against real captures).
// With CLMUL the masked header (behind the 8 bytes of ones) and the payload's first bytes fill a
// 64/128-byte block folded ahead of the rest in one pass; otherwise the tables take the header.
uint32_t roce_icrc(const uint8_t* f, const L3& l3, size_t icrc_at) {
    static const uint32_t seed = crc_update_table(0xFFFFFFFFu, reinterpret_cast<const uint8_t*>("\xff\xff\xff\xff\xff\xff\xff\xff"), 8);
    alignas(16) uint8_t block[128];
    const size_t len = l3.ip_len + 20, rest = l3.udp + 20, body = icrc_at - rest;
    // folded: [lead zero bytes][8 x 0xFF][masked headers][borrowed payload] fills the block, the rest of the payload is
    // whole 16-byte lanes (lead makes the total a multiple of 16; zero_lead[lead] starts the state so they count for nothing)
    const size_t lead = (16 - (8 + len + body) % 16) % 16;
    const size_t block_len = lead + len + 8 <= 64 ? 64 : 128, borrow = block_len - lead - 8 - len;
    const bool fold = crc_path != CRC_TABLE, whole = body < borrow;  // whole: the frame ends inside the block
    const size_t front = whole ? block_len - 8 - len - body : lead;    // zeros before the 8 bytes of ones
    uint8_t* hdr = fold ? block + front + 8 : block;
    std::memcpy(hdr, f + l3.ip, len);
    if (l3.v6) {
        hdr[0] |= 0x0F, hdr[1] = hdr[2] = hdr[3] = 0xFF, hdr[7] = 0xFF;
    } else {
        hdr[1] = 0xFF, hdr[8] = 0xFF, hdr[10] = hdr[11] = 0xFF;
    }
    uint8_t* udp = hdr + l3.ip_len;
    udp[6] = udp[7] = 0xFF;
    udp[8 + 4] = 0xFF;
#if defined(__x86_64__)
    if (fold && whole) {
        std::memset(block, 0, front);
        std::memset(block + front, 0xFF, 8);
        std::memcpy(hdr + len, f + rest, body);
        return ~crc_update_folded(zero_lead[front], block, block_len, nullptr, 0);
    }
    if (fold) {
        std::memset(block, 0, lead);
        std::memset(block + lead, 0xFF, 8);
        std::memcpy(hdr + len, f + rest, borrow);
        const uint8_t* p = f + rest + borrow;
        const size_t n = body - borrow;  // a multiple of 16 by the choice of lead
        return ~crc_update_folded(zero_lead[lead], block, block_len, p, n);
    }
#endif
    uint32_t c = crc_update_table(seed, hdr, len);
    return ~crc_update(c, f + rest, body);
}

}  // namespace

// Ethernet II with up to two 802.1Q / 802.1ad tags (the innermost VLAN id is kept).
bool parse_l2(const uint8_t* f, size_t n, PacketRow& r, size_t& l3, uint16_t& type) {
    if (n < 14) return false;
    std::memcpy(r.dst_mac, f, 6);
    std::memcpy(r.src_mac, f + 6, 6);
    size_t off = 12;
    type = be16(f + off);
    for (int tags = 0; (type == 0x8100 || type == 0x88A8) && tags < 2; ++tags) {
        if (n < off + 6) return false;
        r.vlan = int16_t(be16(f + off + 2) & 0x0FFF);
        off += 4;
        type = be16(f + off);
    }
    l3 = off + 2;
    return true;
}

// IPv4/IPv6 + UDP up to the port check.  Returns NOT_ROCE, MALFORMED or OK (= UDP to 4791 with
// consistent lengths, fully captured).
Status parse_ip_udp(const uint8_t* f, size_t n, size_t ip, uint16_t type, PacketRow& r, L3& l3) {
    size_t avail = n - ip, ip_total;
    const uint8_t* h = f + ip;
    if (type == 0x0800) {
        if (avail < 20 || (h[0] >> 4) != 4) return MALFORMED;
        size_t ihl = size_t(h[0] & 0x0F) * 4;
        ip_total = be16(h + 2);
        if (ihl < 20 || ihl > avail || ip_total < ihl) return MALFORMED;
        if (h[9] != 17 || (be16(h + 6) & 0x1FFF) != 0) return NOT_ROCE;  // not UDP, or a later fragment
        r.ip_version = 4;
        r.traffic_class = h[1];
        r.hop_limit = h[8];
        std::memset(r.src_ip, 0, 10), std::memset(r.src_ip + 10, 0xFF, 2), std::memcpy(r.src_ip + 12, h + 12, 4);
        std::memset(r.dst_ip, 0, 10), std::memset(r.dst_ip + 10, 0xFF, 2), std::memcpy(r.dst_ip + 12, h + 16, 4);
        l3 = {ip, ihl, ip + ihl, false};
    } else if (type == 0x86DD) {
        if (avail < 40 || (h[0] >> 4) != 6) return MALFORMED;
        if (h[6] != 17) return NOT_ROCE;  // extension headers never carry RoCEv2
        ip_total = 40 + size_t(be16(h + 4));
        r.ip_version = 6;
        r.traffic_class = uint8_t(be16(h) >> 4);
        r.hop_limit = h[7];
        std::memcpy(r.src_ip, h + 8, 16);
        std::memcpy(r.dst_ip, h + 24, 16);
        l3 = {ip, 40, ip + 40, true};
    } else {
        return NOT_ROCE;
    }
    if (n < l3.udp + 4) return MALFORMED;
    if (be16(f + l3.udp + 2) != 4791) return NOT_ROCE;
    if (n < l3.udp + 8 || ip_total > avail) return MALFORMED;  // truncated by the snaplen
    r.sport = be16(f + l3.udp);
    if (size_t(be16(f + l3.udp + 4)) != ip_total - l3.ip_len) return MALFORMED;
    return OK;
}

// BTH, ICRC and the extension headers of a UDP-4791 datagram.
Status parse_bth(const uint8_t* f, const L3& l3, PacketRow& r, bool check_icrc) {
    size_t udp_len = be16(f + l3.udp + 4), bth = l3.udp + 8;
    if (udp_len < 8 + 12 + 4) return MALFORMED;
    const uint8_t* b = f + bth;
    r.bth_offset = uint16_t(bth);
    r.opcode = b[0];
    r.se = b[1] >> 7, r.migreq = (b[1] >> 6) & 1, r.pad = (b[1] >> 4) & 3;
    r.pkey = be16(b + 2);
    r.dqpn = be24(b + 5);
    r.ackreq = b[8] >> 7;
    r.psn = be24(b + 9);
    size_t icrc_at = l3.udp + udp_len - 4;
    if (check_icrc && roce_icrc(f, l3, icrc_at) != le32(f + icrc_at)) return BAD_ICRC;
    const OpInfo& op = ops.op[r.opcode];
    if (op.kind == UNKNOWN || (b[1] & 0x0F) != 0) return MALFORMED;  // unknown opcode or transport version
    size_t off = bth + 12, ext = 4u * (op.deth * 2 + op.reth * 4 + op.aeth + op.imm);
    if (off + ext > icrc_at) return MALFORMED;
    if (op.deth) r.has_deth = 1, r.qkey = be32(f + off), r.src_qpn = be24(f + off + 5), off += 8;
    if (op.reth) r.has_reth = 1, r.va = be64(f + off), r.rkey = be32(f + off + 8), r.dma_len = be32(f + off + 12), off += 16;
    if (op.aeth) r.has_aeth = 1, r.aeth = be32(f + off), off += 4;
    if (op.imm) r.has_imm = 1, r.imm = le32(f + off), off += 4;  // NCCL's immediate is a little-endian size
    size_t seg = icrc_at - off;  // payload + pad
    if (seg % 4 || r.pad > seg) return MALFORMED;
    if ((!op.payload && seg) || (r.pad && (op.role == FIRST || op.role == MIDDLE))) return MALFORMED;
    r.payload_len = int32_t(seg - r.pad);
    if (op.reth && op.role == ONLY && r.dma_len != uint32_t(r.payload_len)) return MALFORMED;  // pad or length lies
    r.payload_off = int64_t(off);
    return OK;
}

FrameTable frame_table(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out) {
    Bytes b = readable(buf), off = readable(offsets, 8), len = readable(lengths, 4);
    MutBytes rows = writable(out, sizeof(PacketRow));
    size_t n = off.size / 8;
    if (len.size / 4 != n || rows.size / sizeof(PacketRow) != n)
        throw py::value_error("offsets, lengths and the output table must have one entry per frame");
    const int64_t* o = reinterpret_cast<const int64_t*>(off.data);
    const int32_t* l = reinterpret_cast<const int32_t*>(len.data);
    for (size_t i = 0; i < n; ++i)
        if (o[i] < 0 || l[i] < 0 || uint64_t(o[i]) + uint64_t(l[i]) > b.size)
            throw py::value_error("frame " + std::to_string(i) + " lies outside the buffer");
    return {b.data, o, l, reinterpret_cast<PacketRow*>(rows.data), n};
}

// Returns the counts the caller reports (N_COUNTS: frames per Status, then frames with a BTH per opcode).
py::array_t<int64_t> parse(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out,
                           bool check_icrc) {
    FrameTable t = frame_table(buf, offsets, lengths, out);
    py::array_t<int64_t> counts{py::ssize_t(N_COUNTS)};
    int64_t* cnt = counts.mutable_data();
    std::fill(cnt, cnt + N_COUNTS, 0);
    {
        py::gil_scoped_release nogil;
        parse_frames(t, 0, t.n, check_icrc, cnt, [](const PacketRow&, size_t) {});
    }
    return counts;
}

// The ICRC a frame should carry (for tests and the Python builder's cross-check); -1 when the
// frame is not a complete RoCEv2 datagram.
int64_t frame_icrc(const py::buffer& frame) {
    Bytes b = readable(frame);
    PacketRow r{};
    size_t ip;
    uint16_t type;
    L3 l3{};
    if (!parse_l2(b.data, b.size, r, ip, type) || parse_ip_udp(b.data, b.size, ip, type, r, l3) != OK) return -1;
    size_t udp_len = be16(b.data + l3.udp + 4);
    if (udp_len < 24) return -1;
    return roce_icrc(b.data, l3, l3.udp + udp_len - 4);
}

}  // namespace mirror
