// What flowcheck._mirror exposes to Python, by the file that defines it; module.cpp binds each with its
// docstring.  Every call takes buffers (pointer + length, checked), releases the GIL around its loops, and raises
// ValueError (py::value_error) for bad arguments and malformed input.
#pragma once

#include <cstdint>
#include <string>

#include "bytes.hpp"

namespace mirror {

// crc.cpp (crc_init, crc_path_name: crc.hpp)
uint32_t crc32(const py::buffer& data, uint32_t value);

// index.cpp
py::tuple index_capture(const py::buffer& file);

// parse.cpp
py::array_t<int64_t> parse(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out,
                           bool check_icrc);
int64_t frame_icrc(const py::buffer& frame);

// reassembly.cpp
py::dict reassemble(const py::buffer& packets, int32_t pmtu, int workers);
py::tuple parse_reassemble(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out,
                           bool check_icrc, int32_t pmtu, int ranges, int workers);

// unpack.cpp
py::tuple ll_unpack(const py::buffer& buf, const py::buffer& segments, py::buffer& out, int64_t expected_flag);
py::tuple ll128_unpack(const py::buffer& buf, const py::buffer& segments, py::buffer& out, int64_t expected_flag);
int64_t simple_copy(const py::buffer& buf, const py::buffer& segments, py::buffer& out);
py::array_t<int64_t> segment_flags(const py::buffer& buf, const py::buffer& segments);

// merge.cpp
py::tuple merge_send(const py::buffer& buf, const py::list& parts, int64_t flag, bool ll, py::buffer& data,
                     py::buffer& copies);
py::list merge_sends(const py::list& jobs);
py::tuple merge_rows(const py::buffer& buf, const py::buffer& segments, const py::buffer& rows, bool ll, py::buffer& data,
                     py::buffer& copies);

// layouts.cpp
py::dict layouts();

// ring.cpp
py::tuple ring_block(const py::buffer& block, py::buffer& out, int64_t at, py::buffer& offsets, py::buffer& lengths,
                     py::buffer& ts_ns, int64_t row);

}  // namespace mirror
