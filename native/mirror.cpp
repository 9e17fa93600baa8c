// flowcheck._mirror: the mirror-capture packet path — index a capture file,
// parse RoCEv2 frames, reassemble RDMA messages by PSN, unpack NCCL lines.
//
// Buffers in, numpy arrays out, the GIL released around every loop, one error
// type (ValueError) for bad arguments and malformed files (Python wraps it in
// CaptureError).  The record layouts are C structs; `layouts()` describes them
// so Python builds matching numpy dtypes instead of restating the offsets.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "joined.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the CRC and record code assume a little-endian host");

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- byte helpers

inline uint16_t be16(const uint8_t* p) { return uint16_t(p[0] << 8 | p[1]); }
inline uint32_t be24(const uint8_t* p) { return uint32_t(p[0]) << 16 | uint32_t(p[1]) << 8 | p[2]; }
inline uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | be24(p + 1); }
inline uint64_t be64(const uint8_t* p) { return uint64_t(be32(p)) << 32 | be32(p + 4); }
inline uint32_t le32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t le64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

// Reads file integers in the byte order of the current pcap section.
struct Reader {
    const uint8_t* p;
    bool swap;
    uint16_t u16(size_t at) const { uint16_t v; std::memcpy(&v, p + at, 2); return swap ? __builtin_bswap16(v) : v; }
    uint32_t u32(size_t at) const { uint32_t v; std::memcpy(&v, p + at, 4); return swap ? __builtin_bswap32(v) : v; }
};

struct Bytes {
    const uint8_t* data;
    size_t size;
};

Bytes readable(const py::buffer& b, size_t itemsize = 0) {
    py::buffer_info info = b.request(false);
    if (itemsize != 0 && (info.ndim != 1 || size_t(info.itemsize) != itemsize || info.strides[0] != info.itemsize))
        throw py::value_error("expected a contiguous 1-d array of " + std::to_string(itemsize) + "-byte items");
    return {static_cast<const uint8_t*>(info.ptr), size_t(info.size * info.itemsize)};
}

struct MutBytes {
    uint8_t* data;
    size_t size;
};

MutBytes writable(py::buffer& b, size_t itemsize = 0) {
    py::buffer_info info = b.request(true);
    if (itemsize != 0 && (info.ndim != 1 || size_t(info.itemsize) != itemsize || info.strides[0] != info.itemsize))
        throw py::value_error("expected a writable contiguous 1-d array of " + std::to_string(itemsize) + "-byte items");
    return {static_cast<uint8_t*>(info.ptr), size_t(info.size * info.itemsize)};
}

// A numpy array of T over the items of `v`, which it takes over: no copy (the reassembly's tables are tens of MB, and
// copying them into fresh pages was ~5% of reassembly).  T is the item itself, or uint8_t for raw rows.
template <class T, class Item, class Alloc>
py::array_t<T> adopt(std::vector<Item, Alloc>&& v) {
    static_assert(sizeof(Item) % sizeof(T) == 0, "rows must be whole items of the array");
    if (v.empty()) return py::array_t<T>(0);
    auto* owner = new std::vector<Item, Alloc>(std::move(v));
    py::capsule release(owner, [](void* p) { delete static_cast<std::vector<Item, Alloc>*>(p); });
    const py::ssize_t n = py::ssize_t(owner->size() * (sizeof(Item) / sizeof(T)));
    return py::array_t<T>({n}, {py::ssize_t(sizeof(T))}, reinterpret_cast<T*>(owner->data()), release);
}

// ---------------------------------------------------------------- CRC32 (IEEE, zlib's)

uint32_t crc_table[8][256];
// The widest folding this CPU has, chosen once at import; FLOWCHECK_CRC=table|pclmul|vpclmul caps it so that the
// tests run every path on one machine (a path the CPU lacks falls back to the next narrower one).
enum CrcPath { CRC_TABLE, CRC_PCLMUL, CRC_VPCLMUL };
CrcPath crc_path = CRC_TABLE;
const char* const crc_path_names[] = {"table", "pclmul", "vpclmul"};
// zero_lead[k]: the raw CRC state that k zero bytes take to 0xFFFFFFFF (the usual start).  The ICRC's folded path
// puts k zeros before its header block so that the payload after the block is a whole number of 16-byte lanes and
// no byte-wise tail is left (the table tail was ~4% of decode CPU); a frame too short to lend the block payload bytes
// (ACKs, flow-control posts) fills the whole block behind up to 127 zeros, so it is folded too (the tables took ~3%).
uint32_t zero_lead[128];

void crc_init() {
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
        for (int k = 1; k < 8; ++k) crc_table[k][i] = (crc_table[k - 1][i] >> 8) ^ crc_table[0][crc_table[k - 1][i] & 0xFF];
    // One zero byte maps state c to T[c & 0xFF] ^ (c >> 8); the top bytes of the 256 table entries are distinct, so
    // the top byte of the result names c & 0xFF and the step can be undone.
    uint8_t by_top[256];
    for (uint32_t i = 0; i < 256; ++i) by_top[crc_table[0][i] >> 24] = uint8_t(i);
    zero_lead[0] = 0xFFFFFFFFu;
    for (int k = 1; k < 128; ++k) {
        uint32_t next = zero_lead[k - 1], low = by_top[next >> 24];
        zero_lead[k] = ((next ^ crc_table[0][low]) << 8) | low;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1")) crc_path = CRC_PCLMUL;
    if (crc_path == CRC_PCLMUL && __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("avx512f"))
        crc_path = CRC_VPCLMUL;
#endif
    const char* cap = std::getenv("FLOWCHECK_CRC");
    if (cap == nullptr || *cap == '\0') return;
    for (int p = CRC_TABLE; p <= CRC_VPCLMUL; ++p)
        if (std::strcmp(cap, crc_path_names[p]) == 0) {
            crc_path = std::min(crc_path, CrcPath(p));
            return;
        }
    throw py::value_error(std::string("FLOWCHECK_CRC=") + cap + ": expected table, pclmul or vpclmul (or unset)");
}

// Slicing-by-8 on the raw (un-inverted) CRC state: the fallback and the tail of the folded path.
uint32_t crc_update_table(uint32_t c, const uint8_t* p, size_t n) {
    while (n >= 8) {
        uint32_t a = le32(p) ^ c, b = le32(p + 4);
        c = crc_table[7][a & 0xFF] ^ crc_table[6][(a >> 8) & 0xFF] ^ crc_table[5][(a >> 16) & 0xFF] ^
            crc_table[4][a >> 24] ^ crc_table[3][b & 0xFF] ^ crc_table[2][(b >> 8) & 0xFF] ^
            crc_table[1][(b >> 16) & 0xFF] ^ crc_table[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
// Folding 64 bytes ahead (both foldings' main step): x^(512+32) and x^(512-32) mod P, bit-reflected, shifted left one.
alignas(16) const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};

// One folding step: x times the constant pair k (its high and low halves), plus the next 16 bytes at p.
__attribute__((target("pclmul,sse4.1"))) inline __m128i fold16(__m128i x, __m128i k, const uint8_t* p) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x11), _mm_clmulepi64_si128(x, k, 0x00)),
                         _mm_loadu_si128((const __m128i*)p));
}

// One 64-byte step of the four-lane folding.
__attribute__((target("pclmul,sse4.1"))) inline void fold64(__m128i& x1, __m128i& x2, __m128i& x3, __m128i& x4,
                                                           __m128i k, const uint8_t* p) {
    x1 = fold16(x1, k, p), x2 = fold16(x2, k, p + 16), x3 = fold16(x3, k, p + 32), x4 = fold16(x4, k, p + 48);
}

// The end of both foldings: four 128-bit lanes folded into one, 16-byte steps over the rest of buf (len a multiple
// of 16), then 128 -> 64 -> 32 bits (Barrett reduction).
__attribute__((target("pclmul,sse4.1"))) inline uint32_t fold_finish(__m128i x1, __m128i x2, __m128i x3, __m128i x4,
                                                                     const uint8_t* buf, size_t len) {
    alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
    alignas(16) static const uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
    alignas(16) static const uint64_t poly[] = {0x01db710641, 0x01f7011641};
    __m128i x0, x5;
    x0 = _mm_load_si128((const __m128i*)k3k4);  // fold the four lanes into one
    for (__m128i next : {x2, x3, x4}) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, next), x5);
    }
    for (; len >= 16; buf += 16, len -= 16) x1 = fold16(x1, x0, buf);
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);  // 128 -> 64 bits
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x0 = _mm_loadl_epi64((const __m128i*)k5k0);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(x1, x0, 0x00), x2);
    x0 = _mm_load_si128((const __m128i*)poly);  // Barrett reduction to 32 bits
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return uint32_t(_mm_extract_epi32(x1, 1));
}

// Carry-less-multiply folding (Intel "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ", the bit-reflected constants zlib/Chromium use).  A 1 KiB RoCE
// payload is the hot path: the table loop would cap parsing near 1 GB/s.
// Takes and returns the raw state.  `pre` (pre_len bytes, a multiple of 64, may be 0) is folded first,
// then buf: the ICRC's masked header goes through the same folding as its payload, without a reduction
// in between.  Needs pre_len + len >= 64 and len a multiple of 16 (and len >= 64 when pre_len is 0).
__attribute__((target("pclmul,sse4.1"))) uint32_t crc_update_clmul(uint32_t crc, const uint8_t* pre, size_t pre_len,
                                                                   const uint8_t* buf, size_t len) {
    __m128i x0, x1, x2, x3, x4;
    const uint8_t* first = pre_len ? pre : buf;
    x1 = _mm_loadu_si128((const __m128i*)(first + 0x00));
    x2 = _mm_loadu_si128((const __m128i*)(first + 0x10));
    x3 = _mm_loadu_si128((const __m128i*)(first + 0x20));
    x4 = _mm_loadu_si128((const __m128i*)(first + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(int(crc)));
    x0 = _mm_load_si128((const __m128i*)k1k2);
    if (pre_len) pre += 64, pre_len -= 64;
    else buf += 64, len -= 64;
    for (; pre_len >= 64; pre += 64, pre_len -= 64) fold64(x1, x2, x3, x4, x0, pre);
    for (; len >= 64; buf += 64, len -= 64) fold64(x1, x2, x3, x4, x0, buf);  // four lanes in parallel
    return fold_finish(x1, x2, x3, x4, buf, len);
}

#define CRC_VPCLMUL_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
// The four lanes of fold64 in one zmm register: x times the pair k in every 128-bit lane, plus the 64 bytes at p.
CRC_VPCLMUL_TARGET inline __m512i fold512(__m512i x, __m512i k, const uint8_t* p) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x11), _mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_loadu_si512(p), 0x96);  // 0x96: a ^ b ^ c
}

// A 128-bit constant pair in all four lanes.
CRC_VPCLMUL_TARGET inline __m512i lanes(const uint64_t* k) {
    return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)k));
}

// crc_update_clmul with 512-bit VPCLMULQDQ (same contract, bit-identical): the 128-bit path's four lanes are one
// zmm register, and from 256 bytes on four registers fold a 256-byte window each step, so no step waits on the
// multiply before it (one register alone is latency-bound at 64 bytes per multiply-and-xor).
CRC_VPCLMUL_TARGET uint32_t crc_update_vclmul(uint32_t crc, const uint8_t* pre, size_t pre_len, const uint8_t* buf,
                                              size_t len) {
    // as k1k2, for folding 128, 192 and 256 bytes ahead (D = 1024, 1536, 2048 bits)
    alignas(16) static const uint64_t k128B[] = {0x01e88ef372, 0x014a7fe880}, k192B[] = {0x01821d8bc0, 0x012e958ac4},
                                      k256B[] = {0x011542778a, 0x01322d1430};
    const __m512i k64 = lanes(k1k2);
    const uint8_t* first = pre_len ? pre : buf;
    __m512i a = _mm512_xor_si512(_mm512_loadu_si512(first), _mm512_zextsi128_si512(_mm_cvtsi32_si128(int(crc))));
    if (pre_len) pre += 64, pre_len -= 64;
    else buf += 64, len -= 64;
    for (; pre_len >= 64; pre += 64, pre_len -= 64) a = fold512(a, k64, pre);
    if (len >= 256) {  // a and the next 192 bytes are the window's four 64-byte quarters, oldest first
        __m512i b = _mm512_loadu_si512(buf), c = _mm512_loadu_si512(buf + 64), d = _mm512_loadu_si512(buf + 128);
        buf += 192, len -= 192;
        const __m512i k256 = lanes(k256B);
        for (; len >= 256; buf += 256, len -= 256)
            a = fold512(a, k256, buf), b = fold512(b, k256, buf + 64), c = fold512(c, k256, buf + 128),
            d = fold512(d, k256, buf + 192);
        const __m512i k192 = lanes(k192B), k128 = lanes(k128B);  // each quarter folded onto the newest at once
        a = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k192, 0x11), _mm512_clmulepi64_epi128(a, k192, 0x00),
                                      _mm512_clmulepi64_epi128(b, k128, 0x11), 0x96);
        a = _mm512_ternarylogic_epi64(a, _mm512_clmulepi64_epi128(b, k128, 0x00),
                                      _mm512_clmulepi64_epi128(c, k64, 0x11), 0x96);
        a = _mm512_ternarylogic_epi64(a, _mm512_clmulepi64_epi128(c, k64, 0x00), d, 0x96);
    }
    for (; len >= 64; buf += 64, len -= 64) a = fold512(a, k64, buf);
    return fold_finish(_mm512_extracti32x4_epi32(a, 0), _mm512_extracti32x4_epi32(a, 1),
                       _mm512_extracti32x4_epi32(a, 2), _mm512_extracti32x4_epi32(a, 3), buf, len);
}

// The folding this CPU has (crc_path is not CRC_TABLE); the contract of crc_update_clmul.
inline uint32_t crc_update_folded(uint32_t crc, const uint8_t* pre, size_t pre_len, const uint8_t* buf, size_t len) {
    return crc_path == CRC_VPCLMUL ? crc_update_vclmul(crc, pre, pre_len, buf, len)
                                   : crc_update_clmul(crc, pre, pre_len, buf, len);
}
#endif

uint32_t crc_update(uint32_t c, const uint8_t* p, size_t n) {
#if defined(__x86_64__)
    if (crc_path != CRC_TABLE && n >= 64) {
        size_t m = n & ~size_t(15);
        c = crc_update_folded(c, nullptr, 0, p, m);
        p += m;
        n -= m;
    }
#endif
    return crc_update_table(c, p, n);
}

uint32_t crc32(const py::buffer& data, uint32_t value) {
    Bytes b = readable(data);
    py::gil_scoped_release nogil;
    return ~crc_update(~value, b.data, b.size);
}

// ---------------------------------------------------------------- capture index

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

// ---------------------------------------------------------------- RoCEv2 parsing

enum Status : uint8_t { OK = 0, NOT_ROCE = 1, BAD_ICRC = 2, MALFORMED = 3 };
enum Role : uint8_t { NO_ROLE, FIRST, MIDDLE, LAST, ONLY };
enum Kind : uint8_t { SEND = 0, WRITE = 1, READ = 2, ACK = 3, UD = 4, OTHER = 5, UNKNOWN = 255 };

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
const OpTable ops;

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

struct L3 {
    size_t ip, ip_len, udp;  // offsets in the frame; ip_len = IP header length
    bool v6;
};

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

Status parse_frame(const uint8_t* f, size_t n, PacketRow& r, bool check_icrc) {
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

// ---------------------------------------------------------------- reassembly

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

// An allocator whose resize() leaves new items uninitialised: for tables sized first and then filled row by row.
template <class T>
struct NoInit : std::allocator<T> {
    template <class U>
    struct rebind { using other = NoInit<U>; };
    NoInit() = default;
    template <class U>
    NoInit(const NoInit<U>&) noexcept {}
    template <class U>
    void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
    template <class U, class... Args>
    void construct(U* p, Args&&... args) { ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...); }
};

// What reassembling one stream (or all of them, concatenated in stream order) produces, but the segment rows: those
// are written through a SegmentSpan into the result's table (Out::segments), sized beforehand (one row per request at
// most), so that streams reassembled on several threads write theirs in place.
struct StreamTables {
    std::vector<MessageRow> messages;
    std::vector<MissingRow> missing;
    std::vector<GapRow> gaps;
};

struct SegmentSpan {
    SegmentRow* at;
    int64_t n = 0;  // rows written; a message's seg_start counts from `at`
};

struct Out : StreamTables {
    std::vector<SegmentRow, NoInit<SegmentRow>> segments;
    std::vector<StreamRow> streams;
    std::vector<int32_t> stream_of, message_of;
};

// A SEND/WRITE packet of a stream, with what placing it reads of its row in every packet (demux reads the row anyway,
// in capture order; placing it later, stream by stream, would read the 128-byte rows again, strided: placing waited
// on those loads more than it computed).  The rest (RETH, immediate) is read from the row where the opcode has it.
struct Req {
    int64_t psn, frame;
    int64_t payload_off, ll_flag;
    int32_t payload_len;
    uint8_t opcode;
    bool operator<(const Req& o) const { return psn != o.psn ? psn < o.psn : frame < o.frame; }
};

struct Key {
    uint8_t b[36];
    bool operator==(const Key& o) const { return std::memcmp(b, o.b, 36) == 0; }
};
struct KeyHash {  // four 8-byte words and the QPN, each mixed in (a byte-wise FNV loop was 1/4 of reassembly)
    size_t operator()(const Key& k) const {
        uint64_t h = le32(k.b + 32);
        for (int i = 0; i < 32; i += 8) h = (h ^ le64(k.b + i)) * 0x9E3779B97F4A7C15ULL, h ^= h >> 29;
        return size_t(h);
    }
};

int64_t unwrap(int64_t prev, uint32_t psn) {
    int64_t d = int64_t((psn - uint32_t(prev)) & 0xFFFFFF);
    return prev + (d >= 0x800000 ? d - 0x1000000 : d);
}

void count_kind(StreamRow& s, Kind k) {
    int32_t* counter[] = {&s.n_sends, &s.n_writes, &s.n_reads, &s.n_acks, &s.n_ud, &s.n_other};
    ++*counter[k];
}

// Demultiplexes OK packets into (src ip, dst ip, dest QP) streams, one packet at a time: collects each stream's RC
// SEND/WRITE packets (one PSN space) with their PSNs unwrapped in capture order, and each stream's PMTU seen (the
// payload of its FIRST/MIDDLE packets, all full by definition; 0: none), read while the row is in cache rather than
// in another pass over the packet table (two such passes were ~8% of decode CPU).  Stream ids count from 0 in order
// of first appearance; `join` appends another Demux that saw the packets right after this one's.
class Demux {
  public:
    std::vector<StreamRow> streams;
    std::vector<std::vector<Req>> reqs;
    std::vector<int32_t> pmtus;

    // Packet i (its row `r`); returns its stream, -1 when it has none (not OK, or an unknown opcode).
    int32_t add(const PacketRow& r, size_t i) {
        Kind kind = ops.op[r.opcode].kind;
        if (r.status != OK || kind == UNKNOWN) return -1;
        Key k = key(r.src_ip, r.dst_ip, r.dqpn);
        if (last_id_ < 0 || !(k == last_)) {  // consecutive packets mostly belong to one stream: skip the lookup then
            auto found = ids_.try_emplace(k, int32_t(streams.size()));
            last_ = k, last_id_ = found.first->second;
            if (found.second) open(r, i);
        }
        StreamRow& s = streams[size_t(last_id_)];
        s.last_frame = int64_t(i), ++s.n_packets;
        count_kind(s, kind);
        if (kind == SEND || kind == WRITE) {
            std::vector<Req>& q = reqs[size_t(last_id_)];
            q.push_back({q.empty() ? int64_t(r.psn) : unwrap(q.back().psn, r.psn), int64_t(i), r.payload_off, r.ll_flag,
                         r.payload_len, r.opcode});
            const Role role = ops.op[r.opcode].role;
            int32_t& seen = pmtus[size_t(last_id_)];
            if (role == FIRST || role == MIDDLE) seen = std::max(seen, r.payload_len);
        }
        return last_id_;
    }

    // Takes in `later`, which demultiplexed the packets right after this one's: its streams continue this one's of the
    // same key (counts added, requests appended, PSNs unwrapped across the seam) or come after them, in its order.
    // Returns what each of its stream ids became here.
    std::vector<int32_t> join(Demux& later) {
        std::vector<int32_t> id(later.streams.size());
        for (size_t ls = 0; ls < later.streams.size(); ++ls) {
            const StreamRow& x = later.streams[ls];
            auto found = ids_.try_emplace(key(x.src_ip, x.dst_ip, x.dqpn), int32_t(streams.size()));
            const size_t g = size_t(found.first->second);
            id[ls] = int32_t(g);
            if (found.second) {
                streams.push_back(x), reqs.push_back(std::move(later.reqs[ls])), pmtus.push_back(later.pmtus[ls]);
                continue;
            }
            StreamRow& s = streams[g];
            s.last_frame = x.last_frame, s.n_packets += x.n_packets;
            s.n_sends += x.n_sends, s.n_writes += x.n_writes, s.n_reads += x.n_reads, s.n_acks += x.n_acks;
            s.n_ud += x.n_ud, s.n_other += x.n_other;
            pmtus[g] = std::max(pmtus[g], later.pmtus[ls]);
            std::vector<Req>& q = reqs[g];
            std::vector<Req>& more = later.reqs[ls];
            if (!q.empty() && !more.empty()) {  // `later` counted its PSNs from its first request's raw PSN
                const int64_t shift = unwrap(q.back().psn, uint32_t(more.front().psn)) - more.front().psn;
                for (Req& m : more) m.psn += shift;
            }
            q.insert(q.end(), more.begin(), more.end());
        }
        last_id_ = -1;
        return id;
    }

  private:
    static Key key(const uint8_t* src_ip, const uint8_t* dst_ip, uint32_t dqpn) {
        Key k;
        std::memcpy(k.b, src_ip, 16), std::memcpy(k.b + 16, dst_ip, 16), std::memcpy(k.b + 32, &dqpn, 4);
        return k;
    }

    void open(const PacketRow& r, size_t i) {
        StreamRow s{};
        s.first_frame = int64_t(i);
        std::memcpy(s.src_ip, r.src_ip, 16), std::memcpy(s.dst_ip, r.dst_ip, 16);
        std::memcpy(s.src_mac, r.src_mac, 6), std::memcpy(s.dst_mac, r.dst_mac, 6);
        s.dqpn = r.dqpn, s.vlan = r.vlan, s.sport = r.sport, s.ip_version = r.ip_version;
        streams.push_back(s);
        reqs.emplace_back();
        pmtus.push_back(0);
    }

    std::unordered_map<Key, int32_t, KeyHash> ids_;
    Key last_{};
    int32_t last_id_ = -1;
};

// demux reads the packet table in order, but the parse wrote it long before (tens of MB): without fetching rows
// ahead it waited on each row's second line (the opcode) for a third of its time (reassembly -10% with 16 ahead)
constexpr size_t DEMUX_AHEAD = 16;

// Demultiplexes a whole packet table (see Demux) in one pass; each packet's stream goes to stream_of.
Demux demux(const PacketRow* rows, size_t n, int32_t* stream_of) {
    Demux d;
    for (size_t i = 0; i < n; ++i) {
        if (i + DEMUX_AHEAD < n) {  // the table was written by the parse long before: fetch its rows ahead
            const char* ahead = reinterpret_cast<const char*>(rows + i + DEMUX_AHEAD);
            __builtin_prefetch(ahead), __builtin_prefetch(ahead + 64);
        }
        stream_of[i] = d.add(rows[i], i);
    }
    return d;
}

// Places one stream's requests (sorted by PSN, duplicates removed) into messages.
// Boundary rule when a FIRST is lost: the message starts right after the previous message's
// end (its LAST, or the end its RETH length implies); at the very start of a stream nothing is
// known, so offsets count from the first packet seen (START_UNKNOWN).  Packets with no boundary
// between them belong to one message, even across a PSN hole.
class Assembler {
  public:
    // Message ids are indices into out.messages (a stream reassembled on its own counts from 0; see reassemble).
    Assembler(int32_t sid, int32_t pmtu, const PacketRow* rows, StreamTables& out, SegmentSpan& segs, int32_t* message_of)
        : sid_(sid), pmtu_(pmtu), rows_(rows), out_(out), segs_(segs), message_of_(message_of) {}

    void place(const Req& q) {
        const OpInfo& op = ops.op[q.opcode];
        bool starts = op.role == FIRST || op.role == ONLY;
        if (open_ && (starts || op.kind != m_.kind || (end_known_ && q.psn > end_psn_))) close(false, true, q.psn);
        if (!open_) begin(op, q);
        append(op, q);
        if (op.role == LAST || op.role == ONLY) close(true, false, 0);
    }

    // Closes a message the capture ended in; returns the PSN after its end when that is known.
    bool finish(int64_t& end) {
        if (!open_) return false;
        close(false, false, 0);
        const MessageRow& m = out_.messages.back();
        end = m.last_psn + 1;
        return !(m.flags & END_UNKNOWN);
    }

  private:
    int64_t packets_for(int64_t len, bool first) const {
        int64_t k = pmtu_ > 0 ? (len + pmtu_ - 1) / pmtu_ : 1;
        return std::max<int64_t>(k, first ? 2 : 1);  // a FIRST always has a LAST after it
    }

    void begin(const OpInfo& op, const Req& q) {
        m_ = MessageRow{};
        m_.stream = sid_, m_.kind = op.kind, m_.first_opcode = q.opcode, m_.pmtu = pmtu_;
        m_.va = -1, m_.dma_len = -1, m_.first_frame = q.frame, m_.seg_start = segs_.n;
        m_.ll_flag = -1, m_.ll_uniform = 1, prev_flag_ = -1;
        seen_.clear();
        open_ = true, end_known_ = false;
        if (op.role == FIRST || op.role == ONLY) {
            m_.first_psn = q.psn;
            if (op.reth) {
                const PacketRow& r = rows_[q.frame];
                m_.va = int64_t(r.va), m_.rkey = r.rkey, m_.dma_len = r.dma_len;
                end_known_ = true, end_psn_ = q.psn + (op.role == ONLY ? 1 : packets_for(r.dma_len, true)) - 1;
            }
        } else if (prev_known_) {
            m_.first_psn = prev_end_ + 1, m_.flags |= START_INFERRED;
        } else {
            m_.first_psn = q.psn, m_.flags |= START_UNKNOWN;
        }
    }

    void append(const OpInfo& op, const Req& q) {
        int64_t pos = q.psn - m_.first_psn, id = int64_t(out_.messages.size());
        bool full = op.role == FIRST || op.role == MIDDLE;  // must be exactly one PMTU; a LAST at most one
        if ((full && q.payload_len != pmtu_) || (op.role == LAST && q.payload_len > pmtu_)) m_.flags |= BAD_LENGTH;
        int64_t msg_off = pmtu_ > 0 || pos == 0 ? pos * pmtu_ : -1;
        if (msg_off < 0) m_.flags |= BAD_LENGTH;
        if (q.payload_len > 0) {
            segs_.at[segs_.n++] = {q.payload_off, msg_off, q.frame, q.psn, int32_t(id), q.payload_len};
            ++m_.n_segs;
            if (q.ll_flag >= 0 && m_.ll_flag < 0) m_.ll_flag = q.ll_flag;
            if (q.ll_flag >= 0 && prev_flag_ >= 0 && q.ll_flag != prev_flag_) m_.ll_uniform = 0;
            prev_flag_ = q.ll_flag;
        }
        if (op.imm) m_.has_imm = 1, m_.imm = rows_[q.frame].imm;
        seen_.push_back(pos);
        ++m_.n_packets, m_.bytes_seen += q.payload_len, m_.last_opcode = q.opcode;
        m_.first_frame = std::min(m_.first_frame, q.frame), m_.last_frame = std::max(m_.last_frame, q.frame);
        last_seen_psn_ = q.psn, last_seen_end_ = msg_off + q.payload_len;
        message_of_[q.frame] = int32_t(id);
    }

    // next_known: a later packet starts after this message, so it ends at next_psn - 1 at most.
    void close(bool last_seen, bool next_known, int64_t next_psn) {
        if (last_seen) {
            m_.last_psn = last_seen_psn_;
            if (end_known_ && end_psn_ != last_seen_psn_) m_.flags |= BAD_LENGTH;
        } else if (end_known_ || next_known) {
            m_.last_psn = end_known_ ? end_psn_ : next_psn - 1;
            m_.flags |= END_INFERRED;
        } else {
            m_.last_psn = last_seen_psn_, m_.flags |= END_UNKNOWN;
        }
        bool start_seen = !(m_.flags & (START_INFERRED | START_UNKNOWN));
        m_.n_expected = (m_.flags & (START_UNKNOWN | END_UNKNOWN)) ? -1 : int32_t(m_.last_psn - m_.first_psn + 1);
        bool whole = start_seen && last_seen && m_.n_packets == m_.n_expected && !(m_.flags & BAD_LENGTH);
        if (m_.kind == WRITE && whole && m_.bytes_seen != m_.dma_len) m_.flags |= BAD_LENGTH, whole = false;
        if (m_.kind == SEND && whole) m_.dma_len = m_.bytes_seen;
        if (m_.dma_len >= 0 && m_.bytes_seen > m_.dma_len) m_.flags |= BAD_LENGTH;
        m_.complete = whole;
        if (!whole) emit_missing(last_seen);
        prev_known_ = !(m_.flags & END_UNKNOWN), prev_end_ = m_.last_psn;
        out_.messages.push_back(m_);
        open_ = false;
    }

    // Byte ranges of the positions no packet filled; a lost packet k covers [k*pmtu, (k+1)*pmtu).
    void emit_missing(bool last_seen) {
        if (pmtu_ <= 0) return;
        int64_t extent = m_.dma_len >= 0 ? m_.dma_len : last_seen ? last_seen_end_ : -1;
        int64_t n_pos = m_.n_expected >= 0 ? m_.n_expected : seen_.back() + 1;
        int32_t id = int32_t(out_.messages.size());
        size_t s = 0;
        for (int64_t k = 0; k < n_pos; ++k) {
            while (s < seen_.size() && seen_[s] < k) ++s;
            if (s < seen_.size() && seen_[s] == k) continue;
            int64_t a = k * pmtu_, b = extent >= 0 ? std::min<int64_t>(extent, a + pmtu_) : a + pmtu_;
            if (a >= b) continue;
            if (!out_.missing.empty() && out_.missing.back().message == id && out_.missing.back().end == a)
                out_.missing.back().end = b;
            else
                out_.missing.push_back({a, b, id, 0});
        }
        if (m_.flags & END_UNKNOWN) out_.missing.push_back({last_seen_end_, -1, id, 0});
    }

    int32_t sid_, pmtu_;
    const PacketRow* rows_;
    StreamTables& out_;
    SegmentSpan& segs_;
    int32_t* message_of_;
    MessageRow m_{};
    std::vector<int64_t> seen_;  // packet positions in the open message, increasing
    bool open_ = false, end_known_ = false, prev_known_ = false;
    int64_t end_psn_ = 0, prev_end_ = 0, last_seen_psn_ = 0, last_seen_end_ = 0;
    int64_t prev_flag_ = -1;  // ll_flag of the open message's last segment
};

void assemble_stream(int32_t sid, StreamRow& s, std::vector<Req>& q, const PacketRow* rows, int32_t pmtu, StreamTables& out,
                     SegmentSpan& segs, int32_t* message_of) {
    if (!std::is_sorted(q.begin(), q.end())) std::sort(q.begin(), q.end());  // by PSN; equal PSNs keep capture order: the first copy wins
    s.pmtu = pmtu;
    size_t first_message = out.messages.size();
    Assembler a(sid, pmtu, rows, out, segs, message_of);
    int64_t expected = 0;
    bool any = false;
    for (const Req& x : q) {
        if (any && x.psn < expected) { ++s.n_duplicates; continue; }
        if (any && x.psn > expected) out.gaps.push_back({expected, x.psn, sid, HOLE});
        a.place(x);
        expected = x.psn + 1, any = true;
    }
    int64_t end = 0;
    if (a.finish(end) && end > expected) out.gaps.push_back({expected, end, sid, TAIL});
    s.n_requests = int32_t(q.size()) - s.n_duplicates;
    s.n_messages = int32_t(out.messages.size() - first_message);
    s.psn_first = any ? q.front().psn : -1, s.psn_last = any ? expected - 1 : -1;
}

// Streams are independent once demultiplexed: with `workers` > 1 each thread reassembles whole streams, each into
// its own tables (message ids from 0) and its own room in the segment table; then the ids are shifted (segments
// and message_of on the threads again, by stream and by frame range) and the rest concatenated in stream order, so the
// result is the same as one thread's.  (Copying the segments out of per-stream tables instead cost as much as
// reassembling them: on 2 threads it was slower than one.)
// `seen`: each stream's PMTU from demux (used when `pmtu` is 0).
void assemble_streams(std::vector<std::vector<Req>>& reqs, const PacketRow* rows, int32_t pmtu,
                      const std::vector<int32_t>& seen, Out& out, int workers) {
    int32_t fallback = pmtu;  // a stream without FIRST/MIDDLE packets borrows the capture's PMTU
    if (!pmtu)
        for (int32_t own : seen) fallback = std::max(fallback, own);
    auto pmtu_of = [&](size_t s) {
        int32_t own = pmtu ? pmtu : seen[s];
        return own ? own : fallback;
    };
    const size_t ns = reqs.size();
    std::vector<int64_t> room(ns + 1, 0);  // stream s may write segment rows [room[s], room[s + 1]): one per request
    for (size_t s = 0; s < ns; ++s) room[s + 1] = room[s] + int64_t(reqs[s].size());
    out.segments.resize(size_t(room[ns]));
    SegmentRow* segs = out.segments.data();
    int32_t* message_of = out.message_of.data();
    if (workers <= 1 || ns < 2) {
        SegmentSpan all{segs};
        for (size_t s = 0; s < ns; ++s) assemble_stream(int32_t(s), out.streams[s], reqs[s], rows, pmtu_of(s), out, all, message_of);
        out.segments.resize(size_t(all.n));
        return;
    }
    // largest streams first, each onto the least loaded thread
    std::vector<size_t> order(ns);
    for (size_t s = 0; s < ns; ++s) order[s] = s;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return reqs[a].size() > reqs[b].size(); });
    const size_t k = std::min<size_t>(size_t(workers), ns);
    std::vector<std::vector<size_t>> mine(k);
    std::vector<size_t> load(k, 0);
    for (size_t s : order) {
        size_t t = size_t(std::min_element(load.begin(), load.end()) - load.begin());
        mine[t].push_back(s), load[t] += reqs[s].size() + 1;
    }
    struct alignas(64) Part : StreamTables {  // a stream's tables on cache lines of their own
        int64_t used = 0;  // its segment rows
    };
    std::vector<Part> parts(ns);
    auto on_threads = [k](auto&& work) {
        Joined threads;
        for (size_t t = 1; t < k; ++t) threads.start(work, t);
        work(size_t(0));
    };
    on_threads([&](size_t t) {
        for (size_t s : mine[t]) {
            SegmentSpan own{segs + room[s]};
            assemble_stream(int32_t(s), out.streams[s], reqs[s], rows, pmtu_of(s), parts[s], own, message_of);
            parts[s].used = own.n;
        }
    });
    std::vector<int32_t> mbase(ns + 1, 0);
    for (size_t s = 0; s < ns; ++s) mbase[s + 1] = mbase[s] + int32_t(parts[s].messages.size());
    const size_t n = out.message_of.size();
    const int32_t* stream_of = out.stream_of.data();
    on_threads([&](size_t t) {
        for (size_t s : mine[t])
            for (SegmentRow* g = segs + room[s]; g < segs + room[s] + parts[s].used; ++g) g->message += mbase[s];
        for (size_t i = n * t / k; i < n * (t + 1) / k; ++i)
            if (message_of[i] >= 0) message_of[i] += mbase[size_t(stream_of[i])];
    });
    size_t nmiss = 0, ngap = 0;
    for (const Part& p : parts) nmiss += p.missing.size(), ngap += p.gaps.size();
    out.messages.reserve(size_t(mbase[ns])), out.missing.reserve(nmiss), out.gaps.reserve(ngap);
    int64_t at = 0;  // where stream s's segments start in the result: its room, less what the ones before left unused
    for (size_t s = 0; s < ns; ++s) {
        Part& p = parts[s];
        if (at != room[s]) std::memmove(segs + at, segs + room[s], size_t(p.used) * sizeof(SegmentRow));
        for (MessageRow m : p.messages) m.seg_start += at, out.messages.push_back(m);
        for (MissingRow m : p.missing) m.message += mbase[s], out.missing.push_back(m);
        out.gaps.insert(out.gaps.end(), p.gaps.begin(), p.gaps.end());
        at += p.used;
    }
    out.segments.resize(size_t(at));
}

py::dict tables(Out&& out) {
    py::dict d;
    d["streams"] = adopt<uint8_t>(std::move(out.streams)), d["messages"] = adopt<uint8_t>(std::move(out.messages));
    d["segments"] = adopt<uint8_t>(std::move(out.segments)), d["missing"] = adopt<uint8_t>(std::move(out.missing));
    d["gaps"] = adopt<uint8_t>(std::move(out.gaps));
    d["stream_of"] = adopt<int32_t>(std::move(out.stream_of)), d["message_of"] = adopt<int32_t>(std::move(out.message_of));
    return d;
}

void check_reassembly_args(int32_t pmtu, int workers) {
    if (pmtu < 0) throw py::value_error("pmtu must be >= 0 (0 = infer from the packets)");
    if (workers < 1 || workers > 256) throw py::value_error("workers must be 1..256, got " + std::to_string(workers));
}

py::dict reassemble(const py::buffer& packets, int32_t pmtu, int workers) {
    Bytes b = readable(packets, sizeof(PacketRow));
    const PacketRow* rows = reinterpret_cast<const PacketRow*>(b.data);
    size_t n = b.size / sizeof(PacketRow);
    check_reassembly_args(pmtu, workers);
    Out out;
    {
        py::gil_scoped_release nogil;
        out.stream_of.resize(n), out.message_of.assign(n, -1);
        Demux d = demux(rows, n, out.stream_of.data());
        out.streams = std::move(d.streams);
        assemble_streams(d.reqs, rows, pmtu, d.pmtus, out, workers);
    }
    return tables(std::move(out));
}

// parse, then reassemble, of the same frames (the same table, counts and tables) in one call, the demultiplexing done
// by the parse's threads: each of `ranges` threads parses a contiguous run of frames and hands every row to its own
// Demux while the row is in cache; the runs' Demuxes are then joined in capture order.  Separately, the demux read the
// whole packet table again (tens of MB, written long before) on one thread.  Returns (counts, tables).
py::tuple parse_reassemble(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out,
                           bool check_icrc, int32_t pmtu, int ranges, int workers) {
    FrameTable t = frame_table(buf, offsets, lengths, out);
    check_reassembly_args(pmtu, workers);
    if (ranges < 1 || ranges > 256) throw py::value_error("ranges must be 1..256, got " + std::to_string(ranges));
    const size_t k = std::min<size_t>(size_t(ranges), std::max<size_t>(t.n, 1));
    py::array_t<int64_t> counts{py::ssize_t(N_COUNTS)};
    int64_t* cnt = counts.mutable_data();
    Out o;
    {
        py::gil_scoped_release nogil;
        o.stream_of.resize(t.n), o.message_of.assign(t.n, -1);
        // a thread's own cache lines: with the Demuxes side by side, one thread's writes of its last stream key
        // evicted the line the other read its vectors from on every packet (the parse on 2 threads took 1/3 longer)
        struct alignas(64) Part {
            Demux demux;
            alignas(64) std::array<int64_t, N_COUNTS> counts{};
        };
        std::vector<Part> parts(k);
        auto work = [&](size_t p) {
            int32_t* stream_of = o.stream_of.data();
            Demux& d = parts[p].demux;
            parse_frames(t, t.n * p / k, t.n * (p + 1) / k, check_icrc, parts[p].counts.data(),
                         [&](const PacketRow& r, size_t i) { stream_of[i] = d.add(r, i); });
        };
        {
            Joined threads;
            for (size_t p = 1; p < k; ++p) threads.start(work, p);
            work(0);
        }
        std::fill(cnt, cnt + N_COUNTS, 0);
        for (const Part& part : parts)
            for (size_t j = 0; j < N_COUNTS; ++j) cnt[j] += part.counts[j];
        Demux& all = parts[0].demux;
        for (size_t p = 1; p < k; ++p) {
            const std::vector<int32_t> id = all.join(parts[p].demux);
            for (size_t i = t.n * p / k; i < t.n * (p + 1) / k; ++i)
                if (o.stream_of[i] >= 0) o.stream_of[i] = id[size_t(o.stream_of[i])];
        }
        o.streams = std::move(all.streams);
        assemble_streams(all.reqs, t.rows, pmtu, all.pmtus, o, workers);
    }
    return py::make_tuple(counts, tables(std::move(o)));
}

// ---------------------------------------------------------------- payload unpacking

// LL lines {u32 data0, u32 flag, u32 data1, u32 flag}: how many of `lines` lines at p have a flag
// word other than f, and the copy of their data words (8 bytes a line) to d.  SSE2 on x86-64.
int64_t ll_bad_lines(const uint8_t* p, int64_t lines, uint32_t f) {
#if defined(__x86_64__)
    {  // the common case first: every flag word right (one OR of XORs a line), else count line by line
        const __m128i fv = _mm_set1_epi32(int(f)), flags = _mm_setr_epi32(0, -1, 0, -1);
        __m128i acc = _mm_setzero_si128();
        const uint8_t* q = p;
        for (int64_t k = 0; k < lines; ++k, q += 16) acc = _mm_or_si128(acc, _mm_xor_si128(_mm_loadu_si128((const __m128i*)q), fv));
        if (_mm_movemask_epi8(_mm_cmpeq_epi32(_mm_and_si128(acc, flags), _mm_setzero_si128())) == 0xFFFF) return 0;
    }
#endif
    int64_t good = 0;
    for (int64_t k = 0; k < lines; ++k, p += 16) good += (le32(p + 4) == f) & (le32(p + 12) == f);
    return lines - good;
}

void ll_copy(uint8_t* d, const uint8_t* p, int64_t lines) {
    int64_t k = 0;
#if defined(__x86_64__)
    for (; k + 2 <= lines; k += 2, p += 32, d += 16) {
        __m128i a = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i*)p), _MM_SHUFFLE(3, 1, 2, 0));
        __m128i b = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i*)(p + 16)), _MM_SHUFFLE(3, 1, 2, 0));
        _mm_storeu_si128((__m128i*)d, _mm_unpacklo_epi64(a, b));
    }
#endif
    for (; k < lines; ++k, p += 16, d += 8) std::memcpy(d, p, 4), std::memcpy(d + 4, p + 8, 4);
}


struct Segments {
    const SegmentRow* rows;
    size_t n;
};

// The rows of a Reassembly.segments array, each checked to lie inside the capture buffer.
Segments in_capture(const Bytes& buf, const py::buffer& segments, const std::string& where = "") {
    Bytes s = readable(segments, sizeof(SegmentRow));
    Segments seg{reinterpret_cast<const SegmentRow*>(s.data), s.size / sizeof(SegmentRow)};
    for (size_t i = 0; i < seg.n; ++i) {
        const SegmentRow& r = seg.rows[i];
        if (r.offset < 0 || r.length < 0 || uint64_t(r.offset) + uint64_t(r.length) > buf.size)
            throw py::value_error(where + "segment " + std::to_string(i) + " lies outside the capture buffer");
    }
    return seg;
}

// Validates every segment against the capture buffer and the output size before the copy loop.
// out_of(seg) gives the output byte range [a, b) the segment fills.
template <class F>
Segments checked(const Bytes& buf, const py::buffer& segments, size_t out_size, int64_t align, F out_of) {
    Segments seg = in_capture(buf, segments);
    for (size_t i = 0; i < seg.n; ++i) {
        const SegmentRow& r = seg.rows[i];
        if (r.msg_offset < 0 || r.msg_offset % align)
            throw py::value_error("segment " + std::to_string(i) + " has message offset " + std::to_string(r.msg_offset) +
                                  ", expected a multiple of " + std::to_string(align));
        auto [a, b] = out_of(r);
        if (b > int64_t(out_size))
            throw py::value_error("segment " + std::to_string(i) + " fills output bytes [" + std::to_string(a) + ", " +
                                  std::to_string(b) + ") but the output holds " + std::to_string(out_size));
    }
    return seg;
}

// NCCL LL: 16-byte lines {u32 data0, u32 flag, u32 data1, u32 flag}; 8 data bytes per line land
// at message offset / 2.  Every flag must equal the reference (expected, else the first line's).
py::tuple ll_unpack(const py::buffer& buf, const py::buffer& segments, py::buffer& out, int64_t expected_flag) {
    Bytes b = readable(buf);
    MutBytes o = writable(out);
    Segments seg = checked(b, segments, o.size, 16, [](const SegmentRow& r) {
        return std::pair<int64_t, int64_t>{r.msg_offset / 2, r.msg_offset / 2 + r.length / 16 * 8};
    });
    int64_t flag = expected_flag, lines = 0, bad = 0;
    {
        py::gil_scoped_release nogil;
        for (size_t i = 0; i < seg.n; ++i) {
            const uint8_t* p = b.data + seg.rows[i].offset;
            uint8_t* d = o.data + seg.rows[i].msg_offset / 2;
            size_t n = size_t(seg.rows[i].length) / 16;
            if (flag < 0 && n > 0) flag = le32(p + 4);
            for (size_t k = 0; k < n; ++k, p += 16, d += 8) {
                std::memcpy(d, p, 4), std::memcpy(d + 4, p + 8, 4);
                bad += le32(p + 4) != uint32_t(flag) || le32(p + 12) != uint32_t(flag);
            }
            lines += int64_t(n), bad += seg.rows[i].length % 16 != 0;  // a torn line is a bad line
        }
    }
    return py::make_tuple(flag, lines, bad);
}

// NCCL LL128: 128-byte lines of 120 data bytes and a u64 flag at the end; data lands at
// (message offset / 128) * 120.
py::tuple ll128_unpack(const py::buffer& buf, const py::buffer& segments, py::buffer& out, int64_t expected_flag) {
    Bytes b = readable(buf);
    MutBytes o = writable(out);
    Segments seg = checked(b, segments, o.size, 128, [](const SegmentRow& r) {
        int64_t a = r.msg_offset / 128 * 120;
        return std::pair<int64_t, int64_t>{a, a + r.length / 128 * 120};
    });
    int64_t flag = expected_flag, lines = 0, bad = 0;
    {
        py::gil_scoped_release nogil;
        for (size_t i = 0; i < seg.n; ++i) {
            const uint8_t* p = b.data + seg.rows[i].offset;
            uint8_t* d = o.data + seg.rows[i].msg_offset / 128 * 120;
            size_t n = size_t(seg.rows[i].length) / 128;
            if (flag < 0 && n > 0) flag = int64_t(le64(p + 120) & INT64_MAX);
            for (size_t k = 0; k < n; ++k, p += 128, d += 120) {
                std::memcpy(d, p, 120);
                bad += le64(p + 120) != uint64_t(flag);
            }
            lines += int64_t(n), bad += seg.rows[i].length % 128 != 0;
        }
    }
    return py::make_tuple(flag, lines, bad);
}

// Simple protocol: the payload is the data; copies each segment to out[msg_offset:].
int64_t simple_copy(const py::buffer& buf, const py::buffer& segments, py::buffer& out) {
    Bytes b = readable(buf);
    MutBytes o = writable(out);
    Segments seg = checked(b, segments, o.size, 1, [](const SegmentRow& r) {
        return std::pair<int64_t, int64_t>{r.msg_offset, r.msg_offset + r.length};
    });
    int64_t copied = 0;
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < seg.n; ++i) {
        std::memcpy(o.data + seg.rows[i].msg_offset, b.data + seg.rows[i].offset, size_t(seg.rows[i].length));
        copied += seg.rows[i].length;
    }
    return copied;
}

// ---------------------------------------------------------------- merging final sends

// An integer argument (anything with __index__) that fits int64, else ValueError.
int64_t as_int64(const py::handle& h, const char* what) {
    PyObject* idx = PyNumber_Index(h.ptr());
    if (idx == nullptr) {
        PyErr_Clear();
        throw py::value_error(std::string(what) + " must be an integer");
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
    Py_DECREF(idx);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        throw py::value_error(std::string(what) + " does not fit 64 bits");
    }
    return int64_t(v);
}

// Merges `count` elements of `src` into `data` (and their `copies`): an element with no copy yet takes it,
// one with copies is compared bitwise (each difference counts; the first copy stays); its count goes
// up, saturating at 255.  Returns the differences.  Whole-run fast paths for the common cases (the
// first copy of every element, or a later copy of every element), one loop otherwise.
template <class W>
int64_t merge_run(uint8_t* data, uint8_t* copies, const uint8_t* src, int64_t count) {
    constexpr int64_t w = sizeof(W);
    uint8_t lo = 255, hi = 0;
    for (int64_t e = 0; e < count; ++e) lo = std::min(lo, copies[e]), hi = std::max(hi, copies[e]);
    int64_t bad = 0;
    if (hi == 0) {  // nothing here yet
        std::memcpy(data, src, size_t(count * w));
        std::memset(copies, 1, size_t(count));
        return 0;
    }
    if (lo > 0) {  // every element has a copy: compare only
        for (int64_t e = 0; e < count; ++e) {
            W old, got;
            std::memcpy(&old, data + e * w, w), std::memcpy(&got, src + e * w, w);
            bad += old != got;
        }
        for (int64_t e = 0; e < count; ++e) copies[e] = uint8_t(copies[e] + (copies[e] != 255));
        return bad;
    }
    for (int64_t e = 0; e < count; ++e) {
        W old, got;
        std::memcpy(&old, data + e * w, w), std::memcpy(&got, src + e * w, w);
        const uint8_t c = copies[e];
        bad += (c != 0) & (old != got);
        W keep = c ? old : got;
        std::memcpy(data + e * w, &keep, w);
        copies[e] = uint8_t(c + (c != 255));
    }
    return bad;
}

// The decoder's merge of one final send into its allreduce.  `parts` is a list of (segments, shift):
// each segment goes to the send's bytes at (msg_offset + shift) (LL: / 2, and only when the segment is
// line-aligned and every line's two flags equal `flag`, so corrupted packets can only leave data missing,
// never wrong), clipped, into a scratch copy of the send's `data.size` elements; the whole elements inside
// the byte range of a segment that placed are present (an element cut by a range edge is not, even when
// the next range holds its rest).
// Then, per present element, in `data` (the send's slice of the allreduce vector, 1/2/4/8-byte items)
// and `copies` (uint8, one per element): the first valid copy wins, an element that already has
// copies is compared bitwise (a difference is counted, the first copy stays), and its count goes up
// (saturating at 255).  Returns (elements present, elements differing, [(status, segment bytes)]):
// the LL segments not placed, per part first the misaligned ones (-1) then those with bad lines
// (status = their number).  Every size and offset is checked; the GIL is released for the work.
// Segments of one stream lie apart in the capture (other streams' packets between them) and were read last by
// the parser: the merge prefetches this many segments ahead (bench_mirror (a): 2 cut merge_send by a fifth).
constexpr size_t PREFETCH_AHEAD = 2;

// One final send to merge: its parts (segment rows with their shift), LL flag and destination slices.  Built with
// the GIL held (every argument checked), merged with it released.
struct MergeJob {
    struct Part {
        const SegmentRow* rows;
        size_t n;
        int64_t shift;
    };
    Bytes b;
    std::vector<Part> parts;
    int64_t flag;
    bool ll;
    uint8_t* out;
    uint8_t* cnt;
    int64_t n, isz;
    int64_t seen = 0, differing = 0;
    std::vector<std::pair<int32_t, int64_t>> unplaced;
};

// Checks merge_send's arguments and builds its job; `keep` holds the segment arrays alive while the GIL is
// released.  `what` prefixes the errors (merge_sends: which job).
MergeJob merge_job(const py::buffer& buf, const py::list& parts, int64_t flag, bool ll, py::buffer& data,
                   py::buffer& copies, std::vector<py::object>& keep, const std::string& what = "") {
    MergeJob j;
    j.b = readable(buf);
    py::buffer_info di, ci;
    try {
        di = data.request(true), ci = copies.request(true);
    } catch (py::error_already_set& e) {
        throw py::value_error(what + "data and copies must be writable arrays (" + std::string(e.what()) + ")");
    }
    j.isz = di.itemsize;
    if (di.ndim != 1 || (j.isz != 1 && j.isz != 2 && j.isz != 4 && j.isz != 8) || (di.size > 1 && di.strides[0] != j.isz))
        throw py::value_error(what + "data must be a writable contiguous 1-d array of 1-, 2-, 4- or 8-byte items");
    if (ci.ndim != 1 || ci.itemsize != 1 || (ci.size > 1 && ci.strides[0] != 1))
        throw py::value_error(what + "copies must be a writable contiguous 1-d uint8 array");
    if (ci.size != di.size)
        throw py::value_error(what + "copies holds " + std::to_string(ci.size) + " counts for " + std::to_string(di.size) +
                              " data elements");
    j.parts.reserve(parts.size());
    for (size_t k = 0; k < parts.size(); ++k) {
        py::handle item = parts[k];
        if (!py::isinstance<py::tuple>(item) || py::len(item) != 2)
            throw py::value_error(what + "part " + std::to_string(k) + " is not a (segments, shift) pair");
        py::tuple t = py::reinterpret_borrow<py::tuple>(item);
        if (!PyObject_CheckBuffer(t[0].ptr()))
            throw py::value_error(what + "part " + std::to_string(k) + ": segments is not an array");
        py::buffer segs = py::reinterpret_borrow<py::buffer>(t[0]);
        Segments rows = in_capture(j.b, segs, what + "part " + std::to_string(k) + ", ");
        j.parts.push_back({rows.rows, rows.n, as_int64(t[1], "shift")});
        keep.push_back(std::move(segs));
    }
    j.flag = flag, j.ll = ll;
    j.out = static_cast<uint8_t*>(di.ptr), j.cnt = static_cast<uint8_t*>(ci.ptr), j.n = di.size;
    return j;
}

// The merge itself (see merge_send); runs without the GIL.
void run_merge(MergeJob& j) {
    const Bytes& b = j.b;
    const bool ll = j.ll;
    const int64_t flag = j.flag, isz = j.isz, n = j.n, size = n * isz;
    uint8_t* out = j.out;
    uint8_t* cnt = j.cnt;
    int64_t seen = 0, differing = 0;
    struct Placed {
        const uint8_t* p;  // LL: its first line; Simple: the payload byte for `lo`
        int64_t lo, hi;
    };
    // Where a segment goes, from its row alone: NOWHERE; MISALIGNED (LL, not on lines); else the byte range [lo, hi)
    // of the send it fills (LL: once its lines are checked; lo >= size: past the send's end, nothing placed)
    enum Where { NOWHERE, MISALIGNED, RANGE };
    auto where = [&](const SegmentRow& r, int64_t shift, int64_t& lo, int64_t& hi) -> Where {
        int64_t pos;
        if (__builtin_add_overflow(r.msg_offset, shift, &pos)) return NOWHERE;  // nowhere in the send
        if (!ll) {
            if (pos < 0) return NOWHERE;
            int64_t m = std::min<int64_t>(r.length, size - pos);
            if (m <= 0) return NOWHERE;
            lo = pos, hi = pos + m;
            return RANGE;
        }
        if (r.length % 16 || pos % 16 || pos < 0) return MISALIGNED;
        lo = pos / 2, hi = std::min<int64_t>(lo + r.length / 2, size);
        return RANGE;
    };
    // The whole elements of each range; in the usual case they follow each other without overlap and each
    // range merges straight from the (cached) packet, else the ranges are unioned through a scratch copy.
    auto elems = [&](const Placed& x) {
        return std::pair<int64_t, int64_t>{(x.lo + isz - 1) / isz, std::min<int64_t>(x.hi / isz, n)};
    };
    auto merge = [&](uint8_t* d, uint8_t* c, const uint8_t* src, int64_t count) -> int64_t {
        switch (isz) {
            case 1: return merge_run<uint8_t>(d, c, src, count);
            case 2: return merge_run<uint16_t>(d, c, src, count);
            case 4: return merge_run<uint32_t>(d, c, src, count);
            default: return merge_run<uint64_t>(d, c, src, count);
        }
    };
    std::vector<uint8_t> line_data;  // one LL segment's data words
    auto merge_ordered = [&](const Placed& x) {  // one range, when the ranges follow each other without overlap
        auto [ea, eb] = elems(x);
        if (ea >= eb) return;
        const uint8_t* src = x.p + (ea * isz - x.lo);  // Simple: the payload itself
        if (ll) {  // LL ranges start on a line, so on an element: unpack the lines, then merge
            int64_t bytes = (eb - ea) * isz, lines = (bytes + 7) / 8;
            if (int64_t(line_data.size()) < lines * 8) line_data.resize(size_t(lines * 8));
            ll_copy(line_data.data(), x.p, lines);
            src = line_data.data();
        }
        seen += eb - ea;
        differing += merge(out + ea * isz, cnt + ea, src, eb - ea);
    };
    // Whether every range a segment could fill (its lines all valid) follows the one before without overlap: then
    // so do those that do fill, and each segment merges as soon as its lines are checked, while they are in cache
    // (checking all of them first read every segment twice: merge_rows -9% in bench_mirror (a)).  Reads only rows.
    bool ordered = true;
    int64_t reach = 0;
    for (const MergeJob::Part& part : j.parts)
        for (size_t i = 0; i < part.n && ordered; ++i) {
            int64_t lo = 0, hi = 0;
            if (where(part.rows[i], part.shift, lo, hi) != RANGE || lo >= size) continue;
            auto [ea, eb] = elems(Placed{nullptr, lo, hi});
            if (ea >= eb) continue;
            if (ea < reach) ordered = false;
            reach = eb;
        }
    // Each segment: its lines checked (LL) -> placed (merged at once when ordered), or reported per part: first the
    // misaligned ones (-1, their bytes), then those with bad lines (their number, 0).
    std::vector<Placed> placed;
    std::vector<int64_t> misaligned, bad_lines;
    for (const MergeJob::Part& part : j.parts) {
        misaligned.clear(), bad_lines.clear();
        for (size_t i = 0; i < part.n; ++i) {
            const SegmentRow& r = part.rows[i];
            const uint8_t* p = b.data + r.offset;
            if (i + PREFETCH_AHEAD < part.n) {  // segments lie apart in the capture: fetch ahead
                const SegmentRow& ahead = part.rows[i + PREFETCH_AHEAD];
                for (int32_t k = 0; k < ahead.length; k += 64) __builtin_prefetch(b.data + ahead.offset + k);
            }
            int64_t lo = 0, hi = 0;
            Where w = where(r, part.shift, lo, hi);
            if (w == NOWHERE) continue;
            if (w == MISALIGNED) { misaligned.push_back(r.length); continue; }
            if (ll) {
                int64_t lines = r.length / 16;
                int64_t bad = flag < 0 ? lines : ll_bad_lines(p, lines, uint32_t(flag));
                if (bad) { bad_lines.push_back(std::min<int64_t>(bad, INT32_MAX)); continue; }
                if (lo >= size) continue;
            }
            if (ordered) merge_ordered(Placed{p, lo, hi});
            else placed.push_back({p, lo, hi});
        }
        for (int64_t v : misaligned) j.unplaced.emplace_back(-1, v);
        for (int64_t v : bad_lines) j.unplaced.emplace_back(int32_t(v), 0);
    }
    if (!ordered) {
        std::unique_ptr<uint8_t[]> scratch(new uint8_t[size_t(std::max<int64_t>(size, 1))]);  // only placed bytes are read
        uint8_t* o = scratch.get();
        std::vector<std::pair<int64_t, int64_t>> present;  // element ranges [a, b)
        for (const Placed& x : placed) {
            if (ll) {
                int64_t fit = (x.hi - x.lo) / 8;
                ll_copy(o + x.lo, x.p, fit);
                if (x.hi > x.lo + fit * 8) {  // a partial last line
                    uint8_t line[8];
                    const uint8_t* q = x.p + 16 * fit;
                    std::memcpy(line, q, 4), std::memcpy(line + 4, q + 8, 4);
                    std::memcpy(o + x.lo + fit * 8, line, size_t(x.hi - (x.lo + fit * 8)));
                }
            } else {
                std::memcpy(o + x.lo, x.p, size_t(x.hi - x.lo));
            }
            auto [ea, eb] = elems(x);
            if (ea < eb) present.emplace_back(ea, eb);
        }
        std::sort(present.begin(), present.end());
        for (size_t i = 0; i < present.size();) {  // the union of the ranges, each run merged once
            int64_t a = present[i].first, e = present[i].second;
            for (++i; i < present.size() && present[i].first <= e; ++i) e = std::max(e, present[i].second);
            seen += e - a;
            differing += merge(out + a * isz, cnt + a, o + a * isz, e - a);
        }
    }
    j.seen = seen, j.differing = differing;
}

py::tuple merge_result(const MergeJob& j) {
    py::list bad;
    for (const auto& [status, bytes] : j.unplaced) bad.append(py::make_tuple(status, bytes));
    return py::make_tuple(j.seen, j.differing, bad);
}

py::tuple merge_send(const py::buffer& buf, const py::list& parts, int64_t flag, bool ll, py::buffer& data,
                     py::buffer& copies) {
    std::vector<py::object> keep;
    MergeJob j = merge_job(buf, parts, flag, ll, data, copies, keep);
    {
        py::gil_scoped_release nogil;
        run_merge(j);
    }
    return merge_result(j);
}

// Several merge_send calls in one, in list order, with the GIL released once for all of them: `jobs` is a list of
// (buf, parts, flag, ll, data, copies) tuples.  Every job is checked before any is merged (a bad one merges
// nothing).  Returns one (seen, differing, unplaced) tuple per job.  Jobs whose destinations overlap must be in one
// call, in the order their copies should count; calls on disjoint destinations may run on different threads.
py::list merge_sends(const py::list& jobs) {
    std::vector<py::object> keep;
    std::vector<MergeJob> js;
    js.reserve(jobs.size());
    for (size_t k = 0; k < jobs.size(); ++k) {
        const std::string what = "job " + std::to_string(k) + ": ";
        py::handle item = jobs[k];
        if (!py::isinstance<py::tuple>(item) || py::len(item) != 6)
            throw py::value_error(what + "expected a (buf, parts, flag, ll, data, copies) tuple");
        py::tuple t = py::reinterpret_borrow<py::tuple>(item);
        if (!py::isinstance<py::list>(t[1])) throw py::value_error(what + "parts must be a list");
        for (int i : {0, 4, 5})
            if (!PyObject_CheckBuffer(t[i].ptr())) throw py::value_error(what + "buf, data and copies must be arrays");
        py::buffer b = py::reinterpret_borrow<py::buffer>(t[0]), d = py::reinterpret_borrow<py::buffer>(t[4]),
                   c = py::reinterpret_borrow<py::buffer>(t[5]);
        js.push_back(merge_job(b, py::reinterpret_borrow<py::list>(t[1]), as_int64(t[2], "flag"), t[3].cast<bool>(), d, c,
                               keep, what));
        keep.push_back(b), keep.push_back(d), keep.push_back(c);
    }
    {
        py::gil_scoped_release nogil;
        for (MergeJob& j : js) run_merge(j);
    }
    py::list out;
    for (const MergeJob& j : js) out.append(merge_result(j));
    return out;
}

// merge_sends for sends that are each one run of a Reassembly.segments table, described by rows instead of Python
// objects: `rows` is an int64 (n, 6) array of (seg_start, seg_end, shift, flag, lo, hi): segments[seg_start:seg_end]
// shifted by `shift`, checked against `flag` (-1: none valid), merged into data[lo:hi] / copies[lo:hi] of the whole
// allreduce.  Each row is what merge_send(buf, [(segments[seg_start:seg_end], shift)], flag, ll, data[lo:hi],
// copies[lo:hi]) does, in row order, the GIL released once.  Every row is checked before any is merged.  Returns
// (seen int64[n], differing int64[n], [(row, status, bytes)] of the LL segments not placed, as merge_send's).
py::tuple merge_rows(const py::buffer& buf, const py::buffer& segments, const py::buffer& rows, bool ll, py::buffer& data,
                     py::buffer& copies) {
    Bytes b = readable(buf);
    Bytes sb = readable(segments, sizeof(SegmentRow));
    const SegmentRow* seg = reinterpret_cast<const SegmentRow*>(sb.data);
    const int64_t nseg = int64_t(sb.size / sizeof(SegmentRow));
    py::buffer_info ri = rows.request(false);
    if (ri.ndim != 2 || ri.shape[1] != 6 || ri.itemsize != 8 || (ri.format != "l" && ri.format != "q") ||
        ri.strides[1] != 8 || ri.strides[0] != 48)
        throw py::value_error("rows must be a C-contiguous int64 array of shape (n, 6)");
    const int64_t* row = static_cast<const int64_t*>(ri.ptr);
    const int64_t n = ri.shape[0];
    py::buffer_info di, ci;
    try {
        di = data.request(true), ci = copies.request(true);
    } catch (py::error_already_set& e) {
        throw py::value_error("data and copies must be writable arrays (" + std::string(e.what()) + ")");
    }
    const int64_t isz = di.itemsize;
    if (di.ndim != 1 || (isz != 1 && isz != 2 && isz != 4 && isz != 8) || (di.size > 1 && di.strides[0] != isz))
        throw py::value_error("data must be a writable contiguous 1-d array of 1-, 2-, 4- or 8-byte items");
    if (ci.ndim != 1 || ci.itemsize != 1 || (ci.size > 1 && ci.strides[0] != 1) || ci.size != di.size)
        throw py::value_error("copies must be a writable contiguous 1-d uint8 array as long as data");
    std::vector<MergeJob> js(size_t(std::max<int64_t>(n, 0)));
    {
        // checked without the GIL too: reading every row's segments took milliseconds, in which a sibling merge
        // thread (run_groups) could not even start (the errors thrown here are raised once the GIL is back)
        py::gil_scoped_release nogil;
        for (int64_t k = 0; k < n; ++k) {
            const int64_t* r = row + 6 * k;
            auto what = [k] { return "row " + std::to_string(k) + ": "; };
            if (r[0] < 0 || r[0] > r[1] || r[1] > nseg)
                throw py::value_error(what() + "segments [" + std::to_string(r[0]) + ", " + std::to_string(r[1]) +
                                      ") outside the " + std::to_string(nseg) + " rows of the table");
            if (r[4] < 0 || r[4] > r[5] || r[5] > di.size)
                throw py::value_error(what() + "elements [" + std::to_string(r[4]) + ", " + std::to_string(r[5]) +
                                      ") outside data of " + std::to_string(di.size));
            if (r[3] < -1) throw py::value_error(what() + "flag must be -1 (none) or a non-negative integer");
            for (int64_t i = r[0]; i < r[1]; ++i)
                if (seg[i].offset < 0 || seg[i].length < 0 || uint64_t(seg[i].offset) + uint64_t(seg[i].length) > b.size)
                    throw py::value_error(what() + "segment " + std::to_string(i) + " lies outside the capture buffer");
            MergeJob& j = js[size_t(k)];
            j.b = b;
            j.parts.push_back({seg + r[0], size_t(r[1] - r[0]), r[2]});
            j.flag = r[3], j.ll = ll, j.isz = isz;
            j.out = static_cast<uint8_t*>(di.ptr) + r[4] * isz, j.cnt = static_cast<uint8_t*>(ci.ptr) + r[4], j.n = r[5] - r[4];
        }
        for (MergeJob& j : js) run_merge(j);
    }
    py::array_t<int64_t> seen{py::ssize_t(n)}, differing{py::ssize_t(n)};
    int64_t* sp = seen.mutable_data();
    int64_t* dp = differing.mutable_data();
    py::list unplaced;
    for (int64_t k = 0; k < n; ++k) {
        const MergeJob& j = js[size_t(k)];
        sp[k] = j.seen, dp[k] = j.differing;
        for (const auto& [status, bytes] : j.unplaced) unplaced.append(py::make_tuple(k, status, bytes));
    }
    return py::make_tuple(seen, differing, unplaced);
}

// The LL flag of every segment's first line (u32 at bytes 4..8), -1 for segments under 16 bytes.
py::array_t<int64_t> segment_flags(const py::buffer& buf, const py::buffer& segments) {
    Bytes b = readable(buf);
    auto [rows, n] = in_capture(b, segments);
    py::array_t<int64_t> flags{py::ssize_t(n)};
    int64_t* f = flags.mutable_data();
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < n; ++i) f[i] = rows[i].length >= 16 ? int64_t(le32(b.data + rows[i].offset + 4)) : -1;
    return flags;
}

// ---------------------------------------------------------------- record layouts

#define FIELD(T, name, fmt) py::make_tuple(#name, fmt, offsetof(T, name))

py::tuple layout(py::list fields, size_t itemsize) { return py::make_tuple(fields, itemsize); }

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


// ---------------------------------------------------------------- PACKET_MMAP (TPACKET_V3) blocks

// Offsets in <linux/if_packet.h>: tpacket_block_desc {version, offset_to_priv, tpacket_hdr_v1 {block_status,
// num_pkts, offset_to_first_pkt, blk_len, ...}} and tpacket3_hdr {tp_next_offset, tp_sec, tp_nsec, tp_snaplen,
// tp_len, tp_status, tp_mac (u16), tp_net (u16), hv1 {tp_rxhash, tp_vlan_tci, tp_vlan_tpid}}; the sockaddr_ll
// follows the header at 48 (its sll_pkttype at +10).
constexpr size_t kBlockNumPkts = 12, kBlockFirst = 16, kBlockLen = 20, kBlockHeader = 48;
constexpr size_t kFrameHeader = 48, kPktTypeAt = kFrameHeader + 10;
constexpr uint32_t kVlanValid = 0x10, kVlanTpidValid = 0x40;
constexpr uint8_t kPacketOutgoing = 4;

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

}  // namespace

PYBIND11_MODULE(_mirror, m) {
    crc_init();
    m.doc() = "flowcheck's mirror-capture packet path: capture index, RoCEv2 parse, reassembly, NCCL unpacking.";
    m.def("layouts", &layouts, "Record layouts: {name: ([(field, numpy format, offset)], itemsize)}.");
    m.def("crc32", &crc32, py::arg("data"), py::arg("value") = 0, "zlib-compatible CRC32 of data, continuing from value.");
    m.def("crc_path", [] { return std::string(crc_path_names[crc_path]); },
          "The CRC32 folding in use: vpclmul, pclmul or table (the CPU's widest, capped by $FLOWCHECK_CRC).");
    m.def("index_capture", &index_capture, py::arg("file"),
          "Index a pcap/pcapng image: (offsets, lengths, ts_ns, linktypes, format). ValueError when malformed.");
    m.def("parse", &parse, py::arg("buf"), py::arg("offsets"), py::arg("lengths"), py::arg("out"),
          py::arg("check_icrc") = true, "Parse every frame into the packet table `out` (one row per frame); returns the frames per status (4) "
          "then per opcode (256, frames with a BTH).");
    m.def("frame_icrc", &frame_icrc, py::arg("frame"), "The ICRC a RoCEv2 frame should carry, or -1 if it is not one.");
    m.def("parse_reassemble", &parse_reassemble, py::arg("buf"), py::arg("offsets"), py::arg("lengths"), py::arg("out"),
          py::arg("check_icrc") = true, py::arg("pmtu") = 0, py::arg("ranges") = 1, py::arg("workers") = 1,
          "parse into `out`, then reassemble, in one call: each of `ranges` threads parses a run of frames and "
          "demultiplexes its rows as it goes; `workers` threads reassemble streams. Returns (counts, tables).");
    m.def("reassemble", &reassemble, py::arg("packets"), py::arg("pmtu") = 0, py::arg("workers") = 1,
          "Streams, messages, segments, missing byte ranges, PSN gaps from a packet table (whole streams on `workers` "
          "threads; the tables do not depend on it).");
    m.def("ll_unpack", &ll_unpack, py::arg("buf"), py::arg("segments"), py::arg("out"), py::arg("expected_flag") = -1,
          "Copy LL data words of the segments into out; returns (flag, lines, bad_lines).");
    m.def("ll128_unpack", &ll128_unpack, py::arg("buf"), py::arg("segments"), py::arg("out"),
          py::arg("expected_flag") = -1, "Copy LL128 data of the segments into out; returns (flag, lines, bad_lines).");
    m.def("merge_send", &merge_send, py::arg("buf"), py::arg("parts"), py::arg("flag"), py::arg("ll"), py::arg("data"),
          py::arg("copies"), "Place a final send's parts into an allreduce's data/copies slices; (seen, differing, unplaced).");
    m.def("merge_sends", &merge_sends, py::arg("jobs"),
          "merge_send over a list of (buf, parts, flag, ll, data, copies) jobs in order, the GIL released once; "
          "one (seen, differing, unplaced) per job.");
    m.def("merge_rows", &merge_rows, py::arg("buf"), py::arg("segments"), py::arg("rows"), py::arg("ll"), py::arg("data"),
          py::arg("copies"),
          "merge_send of sends given as (seg_start, seg_end, shift, flag, lo, hi) rows over one segments table and one "
          "allreduce's data/copies; (seen, differing, [(row, status, bytes)]).");
    m.def("segment_flags", &segment_flags, py::arg("buf"), py::arg("segments"),
          "The LL flag of every segment's first line, -1 for segments under 16 bytes.");
    m.def("ring_block", &ring_block, py::arg("block"), py::arg("out"), py::arg("at"), py::arg("offsets"),
          py::arg("lengths"), py::arg("ts_ns"), py::arg("row"),
          "Copy the frames of a retired TPACKET_V3 block to out[at:] (VLAN tags put back, outgoing skipped); "
          "(rows after, out offset after).");
    m.def("simple_copy", &simple_copy, py::arg("buf"), py::arg("segments"), py::arg("out"),
          "Copy the raw payload of the segments into out at their message offsets; returns bytes copied.");
}
