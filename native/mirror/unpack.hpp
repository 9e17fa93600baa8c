// Payload unpacking, the part the merge shares: NCCL LL line checks and copies, and a segments table checked against
// the capture buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "bytes.hpp"
#include "records.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mirror {

// LL lines {u32 data0, u32 flag, u32 data1, u32 flag}: how many of `lines` lines at p have a flag
// word other than f.  SSE2 on x86-64.
inline int64_t ll_bad_lines(const uint8_t* p, int64_t lines, uint32_t f) {
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

// The data words of `lines` LL lines at p (8 bytes a line) to d.
inline void ll_copy(uint8_t* d, const uint8_t* p, int64_t lines) {
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

// The rows of a Reassembly.segments array, each checked to lie inside the capture buffer; `where` prefixes the error.
Segments in_capture(const Bytes& buf, const py::buffer& segments, const std::string& where = "");

}  // namespace mirror
