// The capture index: where each frame of a pcap or pcapng image lies, how long it is, when it arrived and its link
// type.  Every length is checked against the file before it is used; errors are collected while the GIL is released
// and raised as ValueError once it is back.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "api.hpp"
#include "bytes.hpp"

namespace mirror {

namespace {

// Reads file integers in the byte order of the current pcap section.
struct Reader {
    const uint8_t* p;
    bool swap;
    uint16_t u16(size_t at) const { uint16_t v; std::memcpy(&v, p + at, 2); return swap ? __builtin_bswap16(v) : v; }
    uint32_t u32(size_t at) const { uint32_t v; std::memcpy(&v, p + at, 4); return swap ? __builtin_bswap32(v) : v; }
};

struct Index {
    std::vector<int64_t> offsets, ts_ns;
    std::vector<int32_t> lengths, linktypes;
    std::string error;  // set instead of throwing while the GIL is released
    void add(size_t off, uint32_t len, int64_t ts, uint32_t link) {
        offsets.push_back(int64_t(off));
        lengths.push_back(int32_t(len));
        ts_ns.push_back(ts);
        linktypes.push_back(int32_t(link));
    }
};

struct Interface {
    uint32_t linktype, snaplen;
    bool base2;
    int exponent;
    int64_t offset_s;
};

// Converts a pcapng timestamp in units of 10^-e or 2^-e seconds to ns (128-bit: no overflow).
int64_t to_ns(uint64_t ts, const Interface& itf) {
    unsigned __int128 v = ts;
    if (itf.base2) {
        v = (v * 1000000000u) >> std::min(itf.exponent, 127);
    } else if (itf.exponent <= 9) {
        for (int i = itf.exponent; i < 9; ++i) v *= 10;
    } else {
        for (int i = 9; i < itf.exponent && v != 0; ++i) v /= 10;
    }
    // unsigned, wrapping: a garbled if_tsoffset gives a garbled time, never signed-overflow UB (UBSan found it)
    return int64_t(uint64_t(v) + uint64_t(itf.offset_s) * 1000000000u);
}

std::string at(size_t pos) { return " at byte " + std::to_string(pos); }

// Reads the IDB options this reader needs: if_tsresol (9) and if_tsoffset (14).
void idb_options(const Reader& r, size_t pos, size_t end, Interface& itf, std::string& err) {
    while (pos + 4 <= end) {
        uint16_t code = r.u16(pos), len = r.u16(pos + 2);
        size_t next = pos + 4 + ((size_t(len) + 3) & ~size_t(3));
        if (code == 0) return;
        if (next > end) { err = "pcapng interface option " + std::to_string(code) + " runs past its block" + at(pos); return; }
        if (code == 9 && len >= 1) {
            uint8_t v = r.p[pos + 4];
            itf.base2 = v & 0x80;
            itf.exponent = v & 0x7F;
        } else if (code == 14 && len >= 8) {
            uint64_t lo = r.u32(pos + 4), hi = r.u32(pos + 8);  // u64 in section byte order
            itf.offset_s = int64_t(r.swap ? (lo << 32 | hi) : (hi << 32 | lo));
        }
        pos = next;
    }
}

// One pcapng packet block (EPB 6, OPB 2, SPB 3).  Body = block minus type, length and trailer.
void pcapng_packet(const Reader& r, uint32_t type, size_t body, size_t body_len, const std::vector<Interface>& ifs, Index& ix) {
    size_t hdr = type == 3 ? 4 : 20;
    if (body_len < hdr) { ix.error = "pcapng packet block too short" + at(body - 8); return; }
    uint32_t iface = type == 6 ? r.u32(body) : type == 2 ? r.u16(body) : 0;
    if (iface >= ifs.size()) {
        ix.error = "pcapng packet block names interface " + std::to_string(iface) + " but " + std::to_string(ifs.size()) +
                   " are described" + at(body - 8);
        return;
    }
    const Interface& itf = ifs[iface];
    if (type == 3) {  // SPB: no timestamp, caplen implied by the block
        uint32_t orig = r.u32(body);
        size_t cap = std::min<size_t>(orig, body_len - 4);
        if (itf.snaplen) cap = std::min<size_t>(cap, itf.snaplen);
        ix.add(body + 4, uint32_t(cap), -1, itf.linktype);
        return;
    }
    uint32_t cap = r.u32(body + 12);
    if (cap > body_len - 20) {
        ix.error = "pcapng packet of " + std::to_string(cap) + " bytes does not fit its block body of " + std::to_string(body_len) +
                   at(body - 8);
        return;
    }
    uint64_t ts = uint64_t(r.u32(body + 4)) << 32 | r.u32(body + 8);
    ix.add(body + 20, cap, to_ns(ts, itf), itf.linktype);
}

// Walks the blocks of a pcapng file; every length is checked against the file before use.
void index_pcapng(const uint8_t* p, size_t n, Index& ix) {
    Reader r{p, false};
    std::vector<Interface> ifs;
    size_t pos = 0;
    while (pos < n && ix.error.empty()) {
        if (n - pos < 12) { ix.error = "truncated pcapng block header" + at(pos); return; }
        uint32_t type = r.u32(pos);
        if (type == 0x0A0D0D0A) {  // SHB: its byte-order magic sets the order of the section
            if (n - pos < 28) { ix.error = "truncated pcapng section header" + at(pos); return; }
            uint32_t magic = le32(p + pos + 8);
            if (magic != 0x1A2B3C4D && magic != 0x4D3C2B1A) { ix.error = "bad pcapng byte-order magic" + at(pos); return; }
            r.swap = magic == 0x4D3C2B1A;
            ifs.clear();
        } else if (pos == 0) {
            ix.error = "pcapng file does not start with a section header block";
            return;
        }
        size_t blen = r.u32(pos + 4);
        if (blen < 12 || blen % 4 || blen > n - pos) {
            ix.error = "pcapng block length " + std::to_string(blen) + " is invalid (" + std::to_string(n - pos) +
                       " bytes left)" + at(pos);
            return;
        }
        if (r.u32(pos + blen - 4) != blen) { ix.error = "pcapng block trailer length differs from its header" + at(pos); return; }
        size_t body = pos + 8, body_len = blen - 12;
        if (type == 1) {
            if (body_len < 8) { ix.error = "pcapng interface block too short" + at(pos); return; }
            Interface itf{r.u16(body), r.u32(body + 4), false, 6, 0};
            idb_options(r, body + 8, body + body_len, itf, ix.error);
            ifs.push_back(itf);
        } else if (type == 6 || type == 2 || type == 3) {
            pcapng_packet(r, type, body, body_len, ifs, ix);
        }
        pos += blen;
    }
}

// Classic pcap: 24-byte header, then 16-byte record headers each followed by caplen bytes.
void index_pcap(const uint8_t* p, size_t n, Index& ix) {
    uint32_t magic = le32(p);
    bool swap = magic == 0xD4C3B2A1 || magic == 0x4D3CB2A1;
    bool nano = magic == 0xA1B23C4D || magic == 0x4D3CB2A1;
    Reader r{p, swap};
    if (n < 24) { ix.error = "truncated pcap file header"; return; }
    uint32_t link = r.u32(20) & 0x0FFFFFFF;  // the top bits carry FCS information
    for (size_t pos = 24; pos < n;) {
        if (n - pos < 16) { ix.error = "truncated pcap record header" + at(pos); return; }
        uint32_t cap = r.u32(pos + 8);
        if (cap > n - pos - 16) {
            ix.error = "pcap record of " + std::to_string(cap) + " bytes runs past the end of the file" + at(pos);
            return;
        }
        int64_t ts = int64_t(r.u32(pos)) * 1000000000 + int64_t(r.u32(pos + 4)) * (nano ? 1 : 1000);
        ix.add(pos + 16, cap, ts, link);
        pos += 16 + cap;
    }
}

}  // namespace

py::tuple index_capture(const py::buffer& file) {
    Bytes b = readable(file);
    Index ix;
    std::string format;
    if (b.size < 4) throw py::value_error("file of " + std::to_string(b.size) + " bytes is not a capture");
    uint32_t magic = le32(b.data);
    {
        py::gil_scoped_release nogil;
        if (magic == 0x0A0D0D0A) {
            format = "pcapng";
            index_pcapng(b.data, b.size, ix);
        } else if (magic == 0xA1B2C3D4 || magic == 0xD4C3B2A1 || magic == 0xA1B23C4D || magic == 0x4D3CB2A1) {
            format = "pcap";
            index_pcap(b.data, b.size, ix);
        } else {
            char hex[16];
            std::snprintf(hex, sizeof hex, "0x%08x", magic);
            ix.error = std::string("unknown capture format: first word ") + hex +
                       " is neither a pcap magic nor a pcapng section header";
        }
    }
    if (!ix.error.empty()) throw py::value_error(ix.error);
    return py::make_tuple(adopt<int64_t>(std::move(ix.offsets)), adopt<int32_t>(std::move(ix.lengths)),
                          adopt<int64_t>(std::move(ix.ts_ns)), adopt<int32_t>(std::move(ix.linktypes)), format);
}

}  // namespace mirror
