// Payload unpacking: NCCL LL and LL128 lines, and Simple payloads, copied out of the capture at their message offsets.
#include <string>
#include <utility>

#include "api.hpp"
#include "bytes.hpp"
#include "records.hpp"
#include "unpack.hpp"

namespace mirror {

Segments in_capture(const Bytes& buf, const py::buffer& segments, const std::string& where) {
    Bytes s = readable(segments, sizeof(SegmentRow));
    Segments seg{reinterpret_cast<const SegmentRow*>(s.data), s.size / sizeof(SegmentRow)};
    for (size_t i = 0; i < seg.n; ++i) {
        const SegmentRow& r = seg.rows[i];
        if (r.offset < 0 || r.length < 0 || uint64_t(r.offset) + uint64_t(r.length) > buf.size)
            throw py::value_error(where + "segment " + std::to_string(i) + " lies outside the capture buffer");
    }
    return seg;
}

namespace {

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

}  // namespace

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

}  // namespace mirror
