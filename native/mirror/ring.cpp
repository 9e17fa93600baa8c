// The live capture's PACKET_MMAP ring: the frames of one retired TPACKET_V3 block copied out, checked against the
// block and the outputs.
#include <algorithm>
#include <cstring>

#include "api.hpp"
#include "bytes.hpp"

namespace mirror {

namespace {

// Offsets in <linux/if_packet.h>: tpacket_block_desc {version, offset_to_priv, tpacket_hdr_v1 {block_status,
// num_pkts, offset_to_first_pkt, blk_len, ...}} and tpacket3_hdr {tp_next_offset, tp_sec, tp_nsec, tp_snaplen,
// tp_len, tp_status, tp_mac (u16), tp_net (u16), hv1 {tp_rxhash, tp_vlan_tci, tp_vlan_tpid}}; the sockaddr_ll
// follows the header at 48 (its sll_pkttype at +10).
constexpr size_t kBlockNumPkts = 12, kBlockFirst = 16, kBlockLen = 20, kBlockHeader = 48;
constexpr size_t kFrameHeader = 48, kPktTypeAt = kFrameHeader + 10;
constexpr uint32_t kVlanValid = 0x10, kVlanTpidValid = 0x40;
constexpr uint8_t kPacketOutgoing = 4;

}  // namespace

// Copy the frames of one retired TPACKET_V3 block to out[at:], each followed by the next (a stripped 802.1Q tag
// goes back between the MAC addresses), skipping frames this host sent; their offsets, lengths and receive times
// go to the next rows of offsets/lengths/ts_ns from row `row`.  Every offset and length is checked against the
// block and the outputs.  Returns (rows after, out offset after).
py::tuple ring_block(const py::buffer& block, py::buffer& out, int64_t at, py::buffer& offsets, py::buffer& lengths,
                     py::buffer& ts_ns, int64_t row) {
    Bytes b = readable(block);
    MutBytes o = writable(out), off = writable(offsets, 8), len = writable(lengths, 4), ts = writable(ts_ns, 8);
    const size_t rows = off.size / 8;
    if (len.size / 4 != rows || ts.size / 8 != rows) throw py::value_error("offsets, lengths and ts_ns differ in length");
    if (at < 0 || size_t(at) > o.size || row < 0 || size_t(row) > rows) throw py::value_error("at or row out of range");
    if (b.size < kBlockHeader) throw py::value_error("block shorter than its descriptor");
    const uint32_t n = le32(b.data + kBlockNumPkts), first = le32(b.data + kBlockFirst);
    const size_t blk_len = std::min<size_t>(le32(b.data + kBlockLen), b.size);
    if (size_t(row) + n > rows) throw py::value_error("block holds more frames than the rows left");
    const char* error = nullptr;
    size_t pos = first, w = size_t(at), r = size_t(row);
    {
        py::gil_scoped_release nogil;
        for (uint32_t k = 0; k < n; ++k) {
            if (pos < kBlockHeader || pos + kFrameHeader + 12 > blk_len) { error = "frame header outside the block"; break; }
            const uint8_t* h = b.data + pos;
            const uint32_t next = le32(h), snap = le32(h + 12), status = le32(h + 20);
            uint16_t mac;
            std::memcpy(&mac, h + 24, 2);
            if (mac < kFrameHeader + 12 || pos + mac + size_t(snap) > blk_len) { error = "frame data outside the block"; break; }
            if (h[kPktTypeAt] != kPacketOutgoing) {
                const bool tagged = (status & kVlanValid) && snap >= 12;
                const size_t need = size_t(snap) + (tagged ? 4 : 0);
                if (w + need > o.size) { error = "output buffer too small for the block"; break; }
                const uint8_t* f = h + mac;
                if (tagged) {
                    uint16_t tci, tpid;
                    std::memcpy(&tci, h + 32, 2);
                    std::memcpy(&tpid, h + 36, 2);
                    if (!(status & kVlanTpidValid)) tpid = 0x8100;
                    std::memcpy(o.data + w, f, 12);
                    const uint8_t tag[4] = {uint8_t(tpid >> 8), uint8_t(tpid), uint8_t(tci >> 8), uint8_t(tci)};
                    std::memcpy(o.data + w + 12, tag, 4);
                    std::memcpy(o.data + w + 16, f + 12, snap - 12);
                } else {
                    std::memcpy(o.data + w, f, snap);
                }
                const int64_t t = int64_t(le32(h + 4)) * 1000000000 + le32(h + 8), ow = int64_t(w);
                const int32_t l = int32_t(need);
                std::memcpy(off.data + 8 * r, &ow, 8);
                std::memcpy(len.data + 4 * r, &l, 4);
                std::memcpy(ts.data + 8 * r, &t, 8);
                ++r, w += need;
            }
            if (next == 0) break;
            pos += next;
        }
    }
    if (error) throw py::value_error(error);
    return py::make_tuple(int64_t(r), int64_t(w));
}

}  // namespace mirror
