// CRC32 (IEEE, zlib's): the tables, the folding paths and the choice between them (see crc.hpp).
#include "crc.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "bytes.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mirror {

namespace {

uint32_t crc_table[8][256];
const char* const crc_path_names[] = {"table", "pclmul", "vpclmul"};

}  // namespace

CrcPath crc_path = CRC_TABLE;
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

std::string crc_path_name() { return crc_path_names[crc_path]; }

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
namespace {

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

}  // namespace

// Carry-less-multiply folding (Intel "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ", the bit-reflected constants zlib/Chromium use).  A 1 KiB RoCE
// payload is the hot path: the table loop would cap parsing near 1 GB/s.
// Its contract is in crc.hpp.
CRC_PCLMUL_TARGET uint32_t crc_update_clmul(uint32_t crc, const uint8_t* pre, size_t pre_len, const uint8_t* buf,
                                            size_t len) {
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

namespace {

// The four lanes of fold64 in one zmm register: x times the pair k in every 128-bit lane, plus the 64 bytes at p.
CRC_VPCLMUL_TARGET inline __m512i fold512(__m512i x, __m512i k, const uint8_t* p) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x11), _mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_loadu_si512(p), 0x96);  // 0x96: a ^ b ^ c
}

// A 128-bit constant pair in all four lanes.
CRC_VPCLMUL_TARGET inline __m512i lanes(const uint64_t* k) {
    return _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)k));
}

}  // namespace

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

#endif

uint32_t crc32(const py::buffer& data, uint32_t value) {
    Bytes b = readable(data);
    py::gil_scoped_release nogil;
    return ~crc_update(~value, b.data, b.size);
}

}  // namespace mirror
