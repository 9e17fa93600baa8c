// Merging final sends: the decoder places each final send's segments (LL lines checked against its flag) into its
// allreduce's elements; the first valid copy of an element wins and later copies are compared bitwise.
#include <algorithm>
#include <climits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "api.hpp"
#include "bytes.hpp"
#include "records.hpp"
#include "unpack.hpp"

namespace mirror {

namespace {

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

// Where a segment goes, from its row alone: NOWHERE; MISALIGNED (LL, not on lines); else the byte range [lo, hi) of the
// send it fills (LL: once its lines are checked; lo >= the send's size: past its end, nothing placed).
// where, elements and merge_elements are inline: where runs twice per segment, and called out of line it took ~3% of
// the merge's CPU (perf samples over bench_mirror (a)'s input).
enum Where { NOWHERE, MISALIGNED, RANGE };

inline Where where(const MergeJob& j, const SegmentRow& r, int64_t shift, int64_t& lo, int64_t& hi) {
    const int64_t size = j.n * j.isz;
    int64_t pos;
    if (__builtin_add_overflow(r.msg_offset, shift, &pos)) return NOWHERE;  // nowhere in the send
    if (!j.ll) {
        if (pos < 0) return NOWHERE;
        int64_t m = std::min<int64_t>(r.length, size - pos);
        if (m <= 0) return NOWHERE;
        lo = pos, hi = pos + m;
        return RANGE;
    }
    if (r.length % 16 || pos % 16 || pos < 0) return MISALIGNED;
    lo = pos / 2, hi = std::min<int64_t>(lo + r.length / 2, size);
    return RANGE;
}

// The whole elements of the send's bytes [lo, hi): [first, end).
inline std::pair<int64_t, int64_t> elements(const MergeJob& j, int64_t lo, int64_t hi) {
    return {(lo + j.isz - 1) / j.isz, std::min<int64_t>(hi / j.isz, j.n)};
}

// merge_run of `count` elements from src into the job's elements from `first`, at its item size; the differences.
inline int64_t merge_elements(const MergeJob& j, int64_t first, const uint8_t* src, int64_t count) {
    uint8_t* d = j.out + first * j.isz;
    uint8_t* c = j.cnt + first;
    switch (j.isz) {
        case 1: return merge_run<uint8_t>(d, c, src, count);
        case 2: return merge_run<uint16_t>(d, c, src, count);
        case 4: return merge_run<uint32_t>(d, c, src, count);
        default: return merge_run<uint64_t>(d, c, src, count);
    }
}

// Whether every range a segment could fill (its lines all valid) follows the one before without overlap: then so do
// those that do fill, and each segment merges as soon as its lines are checked, while they are in cache (checking all
// of them first read every segment twice: merge_rows -9% in bench_mirror (a)).  Reads only rows.
bool ranges_ordered(const MergeJob& j) {
    const int64_t size = j.n * j.isz;
    int64_t reach = 0;
    for (const MergeJob::Part& part : j.parts)
        for (size_t i = 0; i < part.n; ++i) {
            int64_t lo = 0, hi = 0;
            if (where(j, part.rows[i], part.shift, lo, hi) != RANGE || lo >= size) continue;
            auto [ea, eb] = elements(j, lo, hi);
            if (ea >= eb) continue;
            if (ea < reach) return false;
            reach = eb;
        }
    return true;
}

// A segment that fills the send's bytes [lo, hi).
struct Placed {
    const uint8_t* p;  // LL: its first line; Simple: the payload byte for `lo`
    int64_t lo, hi;
};

// What run_merge keeps from segment to segment.
struct MergeScratch {
    std::vector<Placed> placed;                  // the segments that fill, when the ranges are not ordered
    std::vector<uint8_t> line_data;              // one LL segment's data words
    std::vector<int64_t> misaligned, bad_lines;  // one part's LL segments not placed
};

// One range, when the ranges follow each other without overlap: merged straight from the (cached) packet.
void merge_in_order(MergeJob& j, const Placed& x, std::vector<uint8_t>& line_data) {
    auto [ea, eb] = elements(j, x.lo, x.hi);
    if (ea >= eb) return;
    const uint8_t* src = x.p + (ea * j.isz - x.lo);  // Simple: the payload itself
    if (j.ll) {  // LL ranges start on a line, so on an element: unpack the lines, then merge
        int64_t bytes = (eb - ea) * j.isz, lines = (bytes + 7) / 8;
        if (int64_t(line_data.size()) < lines * 8) line_data.resize(size_t(lines * 8));
        ll_copy(line_data.data(), x.p, lines);
        src = line_data.data();
    }
    j.seen += eb - ea;
    j.differing += merge_elements(j, ea, src, eb - ea);
}

// One part's segments: each one's lines checked (LL) -> placed (merged at once when `ordered`, else kept in
// s.placed), or reported in j.unplaced: first the misaligned ones (-1, their bytes), then those with bad lines (their
// number, 0).
void place_part(MergeJob& j, const MergeJob::Part& part, bool ordered, MergeScratch& s) {
    const bool ll = j.ll;
    const int64_t flag = j.flag, size = j.n * j.isz;
    const uint8_t* data = j.b.data;
    s.misaligned.clear(), s.bad_lines.clear();
    for (size_t i = 0; i < part.n; ++i) {
        const SegmentRow& r = part.rows[i];
        const uint8_t* p = data + r.offset;
        if (i + PREFETCH_AHEAD < part.n) {  // segments lie apart in the capture: fetch ahead
            const SegmentRow& ahead = part.rows[i + PREFETCH_AHEAD];
            for (int32_t k = 0; k < ahead.length; k += 64) __builtin_prefetch(data + ahead.offset + k);
        }
        int64_t lo = 0, hi = 0;
        Where w = where(j, r, part.shift, lo, hi);
        if (w == NOWHERE) continue;
        if (w == MISALIGNED) { s.misaligned.push_back(r.length); continue; }
        if (ll) {
            int64_t lines = r.length / 16;
            int64_t bad = flag < 0 ? lines : ll_bad_lines(p, lines, uint32_t(flag));
            if (bad) { s.bad_lines.push_back(std::min<int64_t>(bad, INT32_MAX)); continue; }
            if (lo >= size) continue;
        }
        if (ordered) merge_in_order(j, Placed{p, lo, hi}, s.line_data);
        else s.placed.push_back({p, lo, hi});
    }
    for (int64_t v : s.misaligned) j.unplaced.emplace_back(-1, v);
    for (int64_t v : s.bad_lines) j.unplaced.emplace_back(int32_t(v), 0);
}

// A placed segment's bytes into o, a scratch copy of the send, at x.lo (LL: its data words, a partial last line too).
void copy_placed(bool ll, uint8_t* o, const Placed& x) {
    if (!ll) {
        std::memcpy(o + x.lo, x.p, size_t(x.hi - x.lo));
        return;
    }
    int64_t fit = (x.hi - x.lo) / 8;
    ll_copy(o + x.lo, x.p, fit);
    if (x.hi > x.lo + fit * 8) {  // a partial last line
        uint8_t line[8];
        const uint8_t* q = x.p + 16 * fit;
        std::memcpy(line, q, 4), std::memcpy(line + 4, q + 8, 4);
        std::memcpy(o + x.lo + fit * 8, line, size_t(x.hi - (x.lo + fit * 8)));
    }
}

// The placed segments when their ranges overlap or come out of order: unioned through a scratch copy of the send,
// each run of present elements merged once.
void merge_through_scratch(MergeJob& j, const std::vector<Placed>& placed) {
    const int64_t size = j.n * j.isz;
    std::unique_ptr<uint8_t[]> scratch(new uint8_t[size_t(std::max<int64_t>(size, 1))]);  // only placed bytes are read
    uint8_t* o = scratch.get();
    std::vector<std::pair<int64_t, int64_t>> present;  // element ranges [a, b)
    for (const Placed& x : placed) {
        copy_placed(j.ll, o, x);
        auto [ea, eb] = elements(j, x.lo, x.hi);
        if (ea < eb) present.emplace_back(ea, eb);
    }
    std::sort(present.begin(), present.end());
    for (size_t i = 0; i < present.size();) {  // the union of the ranges, each run merged once
        int64_t a = present[i].first, e = present[i].second;
        for (++i; i < present.size() && present[i].first <= e; ++i) e = std::max(e, present[i].second);
        j.seen += e - a;
        j.differing += merge_elements(j, a, o + a * j.isz, e - a);
    }
}

// The merge itself (see merge_send); runs without the GIL.  In the usual case the ranges follow each other without
// overlap and each segment merges straight from its packet, else they are unioned through a scratch copy.
void run_merge(MergeJob& j) {
    j.seen = 0, j.differing = 0;
    const bool ordered = ranges_ordered(j);
    MergeScratch s;
    for (const MergeJob::Part& part : j.parts) place_part(j, part, ordered, s);
    if (!ordered) merge_through_scratch(j, s.placed);
}

py::tuple merge_result(const MergeJob& j) {
    py::list bad;
    for (const auto& [status, bytes] : j.unplaced) bad.append(py::make_tuple(status, bytes));
    return py::make_tuple(j.seen, j.differing, bad);
}

}  // namespace

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

}  // namespace mirror
