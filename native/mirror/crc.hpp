// CRC32 (IEEE, zlib's) over raw (un-inverted) states: slicing-by-8 tables, and carry-less-multiply folding
// (PCLMULQDQ, VPCLMULQDQ) where the CPU has it.  The RoCEv2 ICRC (parse.cpp) folds its masked header block through
// crc_update_folded ahead of the payload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mirror {

// The widest folding this CPU has, chosen once at import by crc_init; FLOWCHECK_CRC=table|pclmul|vpclmul caps it so
// that the tests run every path on one machine (a path the CPU lacks falls back to the next narrower one).
enum CrcPath { CRC_TABLE, CRC_PCLMUL, CRC_VPCLMUL };
extern CrcPath crc_path;
// zero_lead[k]: the raw CRC state that k zero bytes take to 0xFFFFFFFF (the usual start); see crc.cpp.
extern uint32_t zero_lead[128];

// Builds the tables and chooses crc_path; ValueError for a FLOWCHECK_CRC it does not know.  Called once, at import.
void crc_init();
std::string crc_path_name();

// Slicing-by-8 on the raw (un-inverted) CRC state: the fallback and the tail of the folded path.
uint32_t crc_update_table(uint32_t c, const uint8_t* p, size_t n);

#if defined(__x86_64__)
#define CRC_PCLMUL_TARGET __attribute__((target("pclmul,sse4.1")))
#define CRC_VPCLMUL_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))

// Takes and returns the raw state.  `pre` (pre_len bytes, a multiple of 64, may be 0) is folded first, then buf: the
// ICRC's masked header goes through the same folding as its payload, without a reduction in between.  Needs
// pre_len + len >= 64 and len a multiple of 16 (and len >= 64 when pre_len is 0).
CRC_PCLMUL_TARGET uint32_t crc_update_clmul(uint32_t crc, const uint8_t* pre, size_t pre_len, const uint8_t* buf,
                                            size_t len);
// crc_update_clmul with 512-bit VPCLMULQDQ (same contract, bit-identical).
CRC_VPCLMUL_TARGET uint32_t crc_update_vclmul(uint32_t crc, const uint8_t* pre, size_t pre_len, const uint8_t* buf,
                                              size_t len);

// The folding this CPU has (crc_path is not CRC_TABLE); the contract of crc_update_clmul.
inline uint32_t crc_update_folded(uint32_t crc, const uint8_t* pre, size_t pre_len, const uint8_t* buf, size_t len) {
    return crc_path == CRC_VPCLMUL ? crc_update_vclmul(crc, pre, pre_len, buf, len)
                                   : crc_update_clmul(crc, pre, pre_len, buf, len);
}
#endif

inline uint32_t crc_update(uint32_t c, const uint8_t* p, size_t n) {
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

}  // namespace mirror
