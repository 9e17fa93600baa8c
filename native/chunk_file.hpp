// Dense zarr v3 shard files of fixed-size uncompressed inner chunks, written and read in one pass.
//
// Layout (zarr's sharding codec with codecs [bytes, crc32c] and the index at the end):
//   chunk 0 bytes | crc32c | chunk 1 bytes | crc32c | ... | index: (offset, nbytes) u64 LE per chunk | crc32c
// Every chunk is stored full size (the last one padded with the fill value 0), so chunk i
// lies at i * (C + 4).  The writer checksums each chunk, hashes the data (xxh3-128 per
// call: a shard's digest) and the file (xxh3-128: the file's digest), and writes, all in
// blocks small enough to stay in cache between the passes; the reader is its mirror.
#pragma once

#include <sys/uio.h>
#include <unistd.h>
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "crc32c.hpp"
#include "joined.hpp"
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

namespace fc_chunk {

constexpr size_t BLOCK = size_t(512) << 10;  // bytes hashed, checksummed and written per pass (cache-sized)
constexpr size_t READ_BLOCK = size_t(512) << 10;  // bytes per read request, checked while in cache (the kernel reads ahead of it)
constexpr int MAX_IOV = 64;
constexpr int MAX_READ_IOV = 512;  // IOV_MAX is 1024

struct IoError {
    int err;
};
struct DataError {
    std::string what;
};

inline std::string hex128(XXH128_hash_t h) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    static const char* digits = "0123456789abcdef";
    std::string out(32, '0');
    for (int i = 0; i < 16; i++) {
        out[2 * i] = digits[c.digest[i] >> 4];
        out[2 * i + 1] = digits[c.digest[i] & 15];
    }
    return out;
}

class Hasher {
  public:
    Hasher() { XXH3_128bits_reset(&state_); }
    void update(const void* p, size_t n) { XXH3_128bits_update(&state_, p, n); }
    std::string hex() const { return hex128(XXH3_128bits_digest(&state_)); }

  private:
    XXH3_state_t state_;
};

inline void put_le32(unsigned char* out, uint32_t v) {
    for (int i = 0; i < 4; i++) out[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void put_le64(unsigned char* out, uint64_t v) {
    for (int i = 0; i < 8; i++) out[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline uint32_t get_le32(const unsigned char* in) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | in[i];
    return v;
}

// Drops the first n bytes from an iovec array (whole entries, then the front of the next one).
inline void consume(struct iovec*& iov, int& count, size_t n) {
    while (count > 0 && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++, count--;
    }
    if (count > 0) {
        iov->iov_base = static_cast<char*>(iov->iov_base) + n;
        iov->iov_len -= n;
    }
}

// pwritev of every iovec, retrying short writes and EINTR.
inline void pwritev_all(int fd, struct iovec* iov, int count, off_t offset) {
    while (count > 0) {
        ssize_t n = ::pwritev(fd, iov, count, offset);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw IoError{errno};
        }
        if (n == 0) throw IoError{EIO};
        offset += n;
        consume(iov, count, static_cast<size_t>(n));
    }
}

// preadv of every iovec; a file that ends first is truncated (DataError).
inline void preadv_all(int fd, struct iovec* iov, int count, off_t offset) {
    while (count > 0) {
        ssize_t n = ::preadv(fd, iov, count, offset);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw IoError{errno};
        }
        if (n == 0) throw DataError{"the file ends early (truncated)"};
        offset += n;
        consume(iov, count, static_cast<size_t>(n));
    }
}

class Writer {
  public:
    // flush_every > 0: write-back of every flush_every bytes starts as soon as they are written; with bound_dirty
    // the writer then waits for the write-back of the window before (at most ~2 windows of this file dirty), so
    // a state larger than the kernel's dirty limit streams to the disk instead of stalling every writer at once
    Writer(int fd, size_t chunk_bytes, size_t flush_every, bool bound_dirty = false)
        : fd_(fd), chunk_(chunk_bytes), flush_every_(flush_every), bound_dirty_(bound_dirty) {}

    // Appends data to the chunk stream; returns the xxh3-128 (hex) of exactly these bytes (empty when !hash:
    // the caller hashed them already, e.g. to find that an unchanged shard need not be written).
    std::string write(const unsigned char* data, size_t n, bool hash = true) {
        Hasher digest;
        while (n > 0) {
            size_t take = std::min({n, chunk_ - fill_, BLOCK - queued_});
            crc_ = fc_crc::extend(crc_, data, take);
            if (hash) digest.update(data, take);
            queue(data, take);
            fill_ += take, data += take, n -= take;
            if (fill_ == chunk_) close_chunk();
            if (queued_ >= BLOCK || iov_count_ + 2 > MAX_IOV) flush();
        }
        flush();  // the caller's buffer may change once this returns
        return hash ? digest.hex() : std::string();
    }

    // Pads the last chunk, writes the index and its checksum; returns (file bytes, xxh3-128 hex of the file).
    std::pair<uint64_t, std::string> finish() {
        if (fill_ > 0) {
            std::vector<unsigned char> zeros(chunk_ - fill_, 0);
            crc_ = fc_crc::extend(crc_, zeros.data(), zeros.size());
            queue(zeros.data(), zeros.size());
            fill_ = chunk_;
            close_chunk();
            flush();
        }
        std::vector<unsigned char> index(16 * chunks_ + 4);
        for (uint64_t i = 0; i < chunks_; i++) {
            put_le64(&index[16 * i], i * (chunk_ + 4));
            put_le64(&index[16 * i + 8], chunk_ + 4);
        }
        put_le32(&index[16 * chunks_], fc_crc::extend(0, index.data(), 16 * chunks_));
        queue(index.data(), index.size());
        flush();
        return {offset_, file_.hex()};
    }

  private:
    void queue(const unsigned char* p, size_t n) {
        file_.update(p, n);
        iov_[iov_count_++] = {const_cast<unsigned char*>(p), n};
        queued_ += n;
    }

    void close_chunk() {
        put_le32(tails_[iov_count_], crc_);
        queue(tails_[iov_count_], 4);
        crc_ = 0;
        fill_ = 0;
        chunks_++;
    }

    void flush() {
        if (iov_count_ == 0) return;
        pwritev_all(fd_, iov_, iov_count_, static_cast<off_t>(offset_));
        offset_ += queued_;
        since_flush_ += queued_;
        iov_count_ = 0;
        queued_ = 0;
#ifdef SYNC_FILE_RANGE_WRITE
        // start write-back early: the final fsync finds little dirty data, the page cache does not fill up
        if (flush_every_ > 0 && since_flush_ >= flush_every_) {
            const off_t start = static_cast<off_t>(offset_ - since_flush_);
            ::sync_file_range(fd_, start, static_cast<off_t>(since_flush_), SYNC_FILE_RANGE_WRITE);
            if (bound_dirty_ && window_bytes_ > 0)
                ::sync_file_range(fd_, window_start_, static_cast<off_t>(window_bytes_),
                                  SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
            window_start_ = start;
            window_bytes_ = since_flush_;
            since_flush_ = 0;
        }
#endif
    }

    int fd_;
    size_t chunk_, flush_every_;
    bool bound_dirty_;
    off_t window_start_ = 0;
    size_t window_bytes_ = 0;
    uint64_t offset_ = 0, chunks_ = 0;
    size_t fill_ = 0, queued_ = 0, since_flush_ = 0;
    uint32_t crc_ = 0;
    Hasher file_;
    struct iovec iov_[MAX_IOV];
    unsigned char tails_[MAX_IOV][4];
    int iov_count_ = 0;
};

// Reads data bytes [begin, begin + n) of a dense chunk file into out, checking the crc32c of every
// chunk it touches; returns the xxh3-128 (hex) of the bytes read (empty when !hash).
inline std::string read_range(int fd, unsigned char* out, size_t n, uint64_t begin, size_t chunk, bool hash = true,
                              size_t block = READ_BLOCK) {
    Hasher digest;
    uint64_t c = begin / chunk;
    size_t skip = static_cast<size_t>(begin - c * chunk);
    std::vector<unsigned char> scratch;
    auto check = [&](uint64_t index, const unsigned char* body, const unsigned char* tail) {
        if (fc_crc::extend(0, body, chunk) != get_le32(tail))
            throw DataError{"chunk " + std::to_string(index) + " fails its CRC32C"};
    };
    while (n > 0) {
        off_t at = static_cast<off_t>(c * (chunk + 4));
        if (skip > 0 || n < chunk) {  // a chunk the range covers in part: read it whole to check it
            scratch.resize(chunk + 4);
            struct iovec iov = {scratch.data(), chunk + 4};
            preadv_all(fd, &iov, 1, at);
            check(c, scratch.data(), scratch.data() + chunk);
            size_t take = std::min(n, chunk - skip);
            std::memcpy(out, scratch.data() + skip, take);
            if (hash) digest.update(out, take);
            out += take, n -= take, c++, skip = 0;
            continue;
        }
        // whole chunks straight into the destination, a block at a time, checked right after while in cache
        size_t count = std::max<size_t>(1, std::min<size_t>(n / chunk, std::max<size_t>(1, block / chunk)));
        count = std::min<size_t>(count, MAX_READ_IOV / 2);
        struct iovec iov[MAX_READ_IOV];
        unsigned char tails[MAX_READ_IOV / 2][4];
        for (size_t i = 0; i < count; i++) {
            iov[2 * i] = {out + i * chunk, chunk};
            iov[2 * i + 1] = {tails[i], 4};
        }
        preadv_all(fd, iov, static_cast<int>(2 * count), at);
        for (size_t i = 0; i < count; i++) check(c + i, out + i * chunk, tails[i]);
        if (hash) digest.update(out, count * chunk);
        out += count * chunk, n -= count * chunk, c += count;
    }
    return hash ? digest.hex() : std::string();
}

// read_range on `threads` threads over parts cut at chunk boundaries (one thread cannot keep a fast disk
// busy and check its bytes too), then one xxh3 pass over the result: a digest is a single stream.
inline std::string read_range_parallel(int fd, unsigned char* out, size_t n, uint64_t begin, size_t chunk,
                                       int threads, size_t block = READ_BLOCK) {
    constexpr size_t MIN_PART = size_t(16) << 20;
    size_t parts = std::min<size_t>(std::max(threads, 1), n / MIN_PART);
    if (parts <= 1) return read_range(fd, out, n, begin, chunk, true, block);
    Joined pool;
    std::vector<int> io(parts, 0);
    std::vector<std::string> bad(parts);
    size_t at = 0;
    for (size_t i = 0; i < parts && at < n; i++) {
        // part i ends at the first chunk boundary past its share (the last part at the end)
        uint64_t share = begin + (i + 1) * (n / parts);
        size_t end = i + 1 == parts ? n : static_cast<size_t>(std::min<uint64_t>((share + chunk - 1) / chunk * chunk, begin + n) - begin);
        if (end <= at) continue;
        pool.start([&, i, at, end] {
            try {
                read_range(fd, out + at, end - at, begin + at, chunk, false, block);
            } catch (const IoError& e) {
                io[i] = e.err;
            } catch (const DataError& e) {
                bad[i] = e.what;
            }
        });
        at = end;
    }
    pool.join();
    for (size_t i = 0; i < parts; i++) {
        if (io[i]) throw IoError{io[i]};
        if (!bad[i].empty()) throw DataError{bad[i]};
    }
    Hasher digest;
    digest.update(out, n);
    return digest.hex();
}

}  // namespace fc_chunk
