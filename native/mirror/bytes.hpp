// Byte helpers every part of flowcheck._mirror shares: big/little-endian loads, checked views of Python buffers, and
// numpy arrays that take over a vector's items.  Bad arguments raise py::value_error (ValueError), the one error type
// of the module (Python wraps it in CaptureError).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the CRC and record code assume a little-endian host");

namespace py = pybind11;

namespace mirror {

inline uint16_t be16(const uint8_t* p) { return uint16_t(p[0] << 8 | p[1]); }
inline uint32_t be24(const uint8_t* p) { return uint32_t(p[0]) << 16 | uint32_t(p[1]) << 8 | p[2]; }
inline uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | be24(p + 1); }
inline uint64_t be64(const uint8_t* p) { return uint64_t(be32(p)) << 32 | be32(p + 4); }
inline uint32_t le32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t le64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

struct Bytes {
    const uint8_t* data;
    size_t size;
};

inline Bytes readable(const py::buffer& b, size_t itemsize = 0) {
    py::buffer_info info = b.request(false);
    if (itemsize != 0 && (info.ndim != 1 || size_t(info.itemsize) != itemsize || info.strides[0] != info.itemsize))
        throw py::value_error("expected a contiguous 1-d array of " + std::to_string(itemsize) + "-byte items");
    return {static_cast<const uint8_t*>(info.ptr), size_t(info.size * info.itemsize)};
}

struct MutBytes {
    uint8_t* data;
    size_t size;
};

inline MutBytes writable(py::buffer& b, size_t itemsize = 0) {
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

}  // namespace mirror
