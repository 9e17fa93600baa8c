// CRC-32C (Castagnoli), the checksum zarr's crc32c codec stores after every chunk.
//
// SSE4.2's crc32 instruction has a latency of 3 cycles and a throughput of 1: one stream
// over the data runs at a third of what the unit can do.  Three streams over three
// adjacent blocks run in parallel and are joined with a "shift by n zero bytes" operator
// (M. Adler's crc32c.c, zlib licence), so the checksum costs ~1/8 cycle a byte.  Without
// SSE4.2 (checked at run time) a table-driven loop computes the same value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace fc_crc {

constexpr uint32_t POLY = 0x82f63b78;  // reflected Castagnoli polynomial
constexpr size_t LONG = 8192;          // bytes per stream in the 3-way loop (a power of two)
constexpr size_t SHORT = 256;

struct Tables {
    uint32_t bytes[256];      // one byte at a time (the fallback)
    uint32_t long_op[4][256]; // shift a crc over LONG zero bytes
    uint32_t short_op[4][256];
    bool hw;
};

inline uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

inline void gf2_square(uint32_t* square, const uint32_t* mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

// The operator that appends len zero bytes to a crc (len a power of two).
inline void zeros_op(uint32_t* even, size_t len) {
    uint32_t odd[32];
    odd[0] = POLY;  // one zero bit
    uint32_t row = 1;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd);  // two zero bits
    gf2_square(odd, even);  // four zero bits
    do {
        gf2_square(even, odd);  // first pass: one zero byte
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    std::memcpy(even, odd, sizeof(odd));
}

inline void zeros_table(uint32_t table[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        table[0][n] = gf2_times(op, n);
        table[1][n] = gf2_times(op, n << 8);
        table[2][n] = gf2_times(op, n << 16);
        table[3][n] = gf2_times(op, n << 24);
    }
}

inline uint32_t shift(const uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

inline const Tables& tables() {
    static const Tables t = [] {
        Tables out{};
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t c = n;
            for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
            out.bytes[n] = c;
        }
        zeros_table(out.long_op, LONG);
        zeros_table(out.short_op, SHORT);
#if defined(__x86_64__) || defined(__i386__)
        out.hw = __builtin_cpu_supports("sse4.2");
#else
        out.hw = false;
#endif
        return out;
    }();
    return t;
}

inline uint32_t extend_sw(uint32_t crc, const unsigned char* p, size_t n) {
    const Tables& t = tables();
    crc = ~crc;
    while (n--) crc = t.bytes[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint64_t step8(uint64_t crc, const unsigned char* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return __builtin_ia32_crc32di(crc, v);
}

// Three streams of `block` bytes each, joined; returns the running (inverted) register.
__attribute__((target("sse4.2"))) inline uint64_t three_way(uint64_t c0, const unsigned char*& p, size_t& n,
                                                             size_t block, const uint32_t table[4][256]) {
    while (n >= 3 * block) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char* end = p + block;
        do {
            c0 = step8(c0, p);
            c1 = step8(c1, p + block);
            c2 = step8(c2, p + 2 * block);
            p += 8;
        } while (p < end);
        c0 = shift(table, static_cast<uint32_t>(c0)) ^ c1;
        c0 = shift(table, static_cast<uint32_t>(c0)) ^ c2;
        p += 2 * block;
        n -= 3 * block;
    }
    return c0;
}

__attribute__((target("sse4.2"))) inline uint32_t extend_hw(uint32_t crc, const unsigned char* p, size_t n) {
    const Tables& t = tables();
    uint64_t c0 = ~crc;
    while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
        c0 = __builtin_ia32_crc32qi(static_cast<uint32_t>(c0), *p++);
        n--;
    }
    c0 = three_way(c0, p, n, LONG, t.long_op);
    c0 = three_way(c0, p, n, SHORT, t.short_op);
    for (; n >= 8; p += 8, n -= 8) c0 = step8(c0, p);
    while (n--) c0 = __builtin_ia32_crc32qi(static_cast<uint32_t>(c0), *p++);
    return ~static_cast<uint32_t>(c0);
}
#endif

// crc32c of p[0:n] continued from `crc` (0 for a fresh checksum), as google_crc32c.extend computes it.
inline uint32_t extend(uint32_t crc, const void* data, size_t n) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
    if (tables().hw) return extend_hw(crc, p, n);
#endif
    return extend_sw(crc, p, n);
}

}  // namespace fc_crc
