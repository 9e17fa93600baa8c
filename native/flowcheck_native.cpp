// flowcheck._native: the few byte-moving loops on the snapshot hot path.
//
// Every function takes Python buffers (pointer + length), releases the GIL for
// the whole loop, and reports failure as one exception type (OSError with errno
// for I/O, ValueError for bad arguments).  No torch, no allocation of tensors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <fcntl.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "chunk_file.hpp"

namespace py = pybind11;

namespace {

struct View {
    const char* data;
    size_t size;
};

// A strided view would be read or written out of order: every buffer here is C-contiguous.
void require_contiguous(const py::buffer_info& info) {
    for (py::ssize_t i = info.ndim - 1, expect = info.itemsize; i >= 0; --i) {
        if (info.shape[i] > 1 && info.strides[i] != expect)
            throw py::value_error("buffer must be C-contiguous");
        expect *= info.shape[i];
    }
}

View readable(const py::buffer& b) {
    py::buffer_info info = b.request(false);
    require_contiguous(info);
    return {static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

// memcpy with non-temporal stores: the destination goes to memory without first
// being read into the cache (a plain store reads every line it writes) and
// without evicting what the other core's training step keeps there.  For the
// push path's copies, whose destination nobody reads soon.
void stream_copy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
    if (n >= (size_t(64) << 10)) {
        size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
        std::memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; dst += 64, src += 64, n -= 64) {
            const __m128i* in = reinterpret_cast<const __m128i*>(src);
            __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1), c = _mm_loadu_si128(in + 2),
                    d = _mm_loadu_si128(in + 3);
            __m128i* out = reinterpret_cast<__m128i*>(dst);
            _mm_stream_si128(out, a), _mm_stream_si128(out + 1, b), _mm_stream_si128(out + 2, c),
                _mm_stream_si128(out + 3, d);
        }
        _mm_sfence();  // streaming stores are weakly ordered: visible before anything stored after
    }
#endif
    std::memcpy(dst, src, n);
}


// Writes all of `buf` at `offset`, retrying short writes and EINTR.  Every
// `flush_every` bytes it asks the kernel to start write-back of what is written
// (sync_file_range), so the final fsync finds little dirty data and the page
// cache does not fill with one huge shard.  Returns the number of bytes written.
size_t pwrite_all(int fd, const py::buffer& b, long long offset, long long flush_every) {
    View v = readable(b);
    if (offset < 0) throw py::value_error("offset must be >= 0");
    size_t done = 0;
    int err = 0;
    {
        py::gil_scoped_release nogil;
        size_t since_flush = 0;
        off_t flush_start = static_cast<off_t>(offset);
        while (done < v.size) {
            size_t want = std::min<size_t>(v.size - done, size_t(1) << 30);
            ssize_t n = ::pwrite(fd, v.data + done, want, static_cast<off_t>(offset + done));
            if (n < 0) {
                if (errno == EINTR) continue;
                err = errno;
                break;
            }
            if (n == 0) {
                err = EIO;
                break;
            }
            done += static_cast<size_t>(n);
            since_flush += static_cast<size_t>(n);
#ifdef SYNC_FILE_RANGE_WRITE
            if (flush_every > 0 && since_flush >= static_cast<size_t>(flush_every)) {
                ::sync_file_range(fd, flush_start, static_cast<off_t>(since_flush), SYNC_FILE_RANGE_WRITE);
                flush_start += static_cast<off_t>(since_flush);
                since_flush = 0;
            }
#endif
        }
    }
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        throw py::error_already_set();
    }
    return done;
}

// Copies src into dst (same byte length) with up to `threads` threads: the
// memory tier's copy-on-write of a pinned bucket is a multi-GB memcpy that one
// core cannot saturate.
void copy_into(py::buffer dst, const py::buffer& src, int threads, bool stream) {
    py::buffer_info d = dst.request(true);
    require_contiguous(d);
    View s = readable(src);
    size_t dsize = static_cast<size_t>(d.size * d.itemsize);
    if (dsize != s.size)
        throw py::value_error("copy_into: dst has " + std::to_string(dsize) + " bytes, src has " +
                              std::to_string(s.size));
    char* out = static_cast<char*>(d.ptr);
    py::gil_scoped_release nogil;
    size_t min_per_thread = size_t(16) << 20;
    size_t n = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(std::max(threads, 1)),
                                                    s.size / min_per_thread));
    auto copy = stream ? stream_copy : [](char* o, const char* i, size_t k) { std::memcpy(o, i, k); };
    if (n == 1) {
        copy(out, s.data, s.size);
        return;
    }
    size_t step = (s.size + n - 1) / n;
    Joined pool;
    for (size_t i = 0; i < n; ++i) {
        size_t begin = i * step, end = std::min(s.size, begin + step);
        if (begin >= end) break;
        pool.start([=] { copy(out + begin, s.data + begin, end - begin); });
    }
    pool.join();
}

// Flushes every dirty page and inode of the filesystem holding fd (Linux
// syncfs).  One call makes a whole step directory durable, where an fsync per
// file and directory costs a journal commit each (hundreds of small zarr.json
// files per step).
void sync_filesystem(int fd) {
    int rc;
    {
        py::gil_scoped_release nogil;
        rc = ::syncfs(fd);
    }
    if (rc != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        throw py::error_already_set();
    }
}

// A sequence counter shared with another process through a mapped buffer (the
// push transport's shared-memory generation): a 64-bit word at an 8-aligned
// offset, read and written atomically with full fences on both sides, so every
// data store before a store of the counter is visible before it and every data
// load before a load of the counter happened before it (a seqlock on any CPU).
uint64_t* generation_word(const py::buffer& b, py::ssize_t offset, bool write) {
    py::buffer_info info = b.request(write);
    py::ssize_t size = info.size * info.itemsize;
    if (offset < 0 || offset % 8 != 0 || offset + 8 > size)
        throw py::value_error("generation offset " + std::to_string(offset) + ": expected an 8-aligned offset "
                              "with 8 bytes inside a buffer of " + std::to_string(size) + " bytes");
    return reinterpret_cast<uint64_t*>(static_cast<char*>(info.ptr) + offset);
}

uint64_t generation_load(const py::buffer& b, py::ssize_t offset) {
    uint64_t* word = generation_word(b, offset, false);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t value = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return value;
}

void generation_store(const py::buffer& b, py::ssize_t offset, uint64_t value) {
    uint64_t* word = generation_word(b, offset, true);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

[[noreturn]] void raise_errno(int err) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
}

// Runs fn without the GIL; the chunk files' I/O and data errors become OSError / ValueError.
template <class Fn>
auto chunk_call(Fn fn) -> decltype(fn()) {
    int err = 0;
    std::string bad;
    {
        py::gil_scoped_release nogil;
        try {
            return fn();
        } catch (const fc_chunk::IoError& e) {
            err = e.err;
        } catch (const fc_chunk::DataError& e) {
            bad = e.what;
        }
    }
    if (err) raise_errno(err);
    throw py::value_error(bad);
}

uint32_t crc32c(const py::buffer& b, uint32_t crc) {
    View v = readable(b);
    py::gil_scoped_release nogil;
    return fc_crc::extend(crc, v.data, v.size);
}

std::string xxh3_128(const py::buffer& b) {
    View v = readable(b);
    py::gil_scoped_release nogil;
    fc_chunk::Hasher h;
    h.update(v.data, v.size);
    return h.hex();
}

// One shard file being written (see chunk_file.hpp): the fd stays the caller's to fsync and close.
class ChunkWriter {
  public:
    ChunkWriter(int fd, size_t chunk_bytes, size_t flush_every, bool bound_dirty)
        : w_(fd, chunk_bytes, flush_every, bound_dirty) {
        if (chunk_bytes == 0) throw py::value_error("chunk_bytes must be > 0");
    }
    std::string write(const py::buffer& b, bool hash) {
        View v = readable(b);
        if (finished_) throw py::value_error("ChunkWriter.write after finish");
        return chunk_call([&] { return w_.write(reinterpret_cast<const unsigned char*>(v.data), v.size, hash); });
    }
    std::pair<uint64_t, std::string> finish() {
        if (finished_) throw py::value_error("ChunkWriter.finish called twice");
        finished_ = true;
        return chunk_call([&] { return w_.finish(); });
    }

  private:
    fc_chunk::Writer w_;
    bool finished_ = false;
};

std::string read_chunks(int fd, py::buffer dst, uint64_t begin, size_t chunk_bytes, int threads, size_t block_bytes) {
    py::buffer_info d = dst.request(true);
    require_contiguous(d);
    if (chunk_bytes == 0) throw py::value_error("chunk_bytes must be > 0");
    if (block_bytes == 0) throw py::value_error("block_bytes must be > 0");
    auto* out = static_cast<unsigned char*>(d.ptr);
    size_t n = static_cast<size_t>(d.size * d.itemsize);
    return chunk_call([&] { return fc_chunk::read_range_parallel(fd, out, n, begin, chunk_bytes, threads, block_bytes); });
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "flowcheck's native helpers: buffer in, bytes out, GIL released.";
    m.def("pwrite_all", &pwrite_all, py::arg("fd"), py::arg("buffer"), py::arg("offset") = 0,
          py::arg("flush_every") = 0,
          "Write the whole buffer to fd at offset (short writes and EINTR retried); start "
          "write-back every flush_every bytes. Returns bytes written; raises OSError.");
    m.def("sync_filesystem", &sync_filesystem, py::arg("fd"),
          "syncfs(fd): make every dirty page and inode of fd's filesystem durable. Raises OSError.");
    m.def("copy_into", &copy_into, py::arg("dst"), py::arg("src"), py::arg("threads") = 4, py::arg("stream") = false,
          "Copy src into the writable buffer dst (same byte size) with up to `threads` threads; stream=True "
          "writes around the cache (non-temporal stores), for copies nobody reads soon.");
    m.def("crc32c", &crc32c, py::arg("buffer"), py::arg("crc") = 0,
          "CRC-32C of the buffer, continued from crc (google_crc32c.extend's value).");
    m.def("xxh3_128", &xxh3_128, py::arg("buffer"), "xxh3-128 of the buffer, as hex (xxhash's hexdigest).");
    py::class_<ChunkWriter>(m, "ChunkWriter",
                            "Streams one dense zarr shard file of fixed-size inner chunks (crc32c after each, "
                            "index at the end) to fd from offset 0, hashing data and file as it writes.")
        .def(py::init<int, size_t, size_t, bool>(), py::arg("fd"), py::arg("chunk_bytes"), py::arg("flush_every") = 0,
             py::arg("bound_dirty") = false)
        .def("write", &ChunkWriter::write, py::arg("buffer"), py::arg("hash") = true,
             "Append the buffer's bytes to the chunk stream; returns their xxh3-128 (hex), or '' when hash is "
             "False (the caller hashed them already). Raises OSError.")
        .def("finish", &ChunkWriter::finish,
             "Pad the last chunk with zeros, write the index; returns (file bytes, xxh3-128 hex of the file).");
    m.def("read_chunks", &read_chunks, py::arg("fd"), py::arg("dst"), py::arg("begin"), py::arg("chunk_bytes"),
          py::arg("threads") = 1, py::arg("block_bytes") = fc_chunk::READ_BLOCK,
          "Read data bytes [begin, begin + len(dst)) of a dense shard file into dst, checking the crc32c of every "
          "chunk touched (parts of >= 16 MiB on up to `threads` threads, requests of block_bytes); returns the "
          "xxh3-128 (hex) of dst. OSError for I/O, ValueError for a bad or short file.");
    m.def("generation_load", &generation_load, py::arg("buffer"), py::arg("offset"),
          "Atomically read the 64-bit counter at offset (8-aligned), fenced on both sides.");
    m.def("generation_store", &generation_store, py::arg("buffer"), py::arg("offset"), py::arg("value"),
          "Atomically write the 64-bit counter at offset (8-aligned), fenced on both sides.");
}
