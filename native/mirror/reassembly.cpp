// Reassembly: packets demultiplexed into (src ip, dst ip, dest QP) streams, each stream's SEND/WRITE packets placed
// in their RDMA messages by PSN, with the byte ranges and PSN gaps no packet filled; whole streams on threads.
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "../joined.hpp"
#include "api.hpp"
#include "bytes.hpp"
#include "parse.hpp"
#include "records.hpp"

namespace mirror {

namespace {

// An allocator whose resize() leaves new items uninitialised: for tables sized first and then filled row by row.
template <class T>
struct NoInit : std::allocator<T> {
    template <class U>
    struct rebind { using other = NoInit<U>; };
    NoInit() = default;
    template <class U>
    NoInit(const NoInit<U>&) noexcept {}
    template <class U>
    void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
    template <class U, class... Args>
    void construct(U* p, Args&&... args) { ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...); }
};

// What reassembling one stream (or all of them, concatenated in stream order) produces, but the segment rows: those
// are written through a SegmentSpan into the result's table (Out::segments), sized beforehand (one row per request at
// most), so that streams reassembled on several threads write theirs in place.
struct StreamTables {
    std::vector<MessageRow> messages;
    std::vector<MissingRow> missing;
    std::vector<GapRow> gaps;
};

struct SegmentSpan {
    SegmentRow* at;
    int64_t n = 0;  // rows written; a message's seg_start counts from `at`
};

struct Out : StreamTables {
    std::vector<SegmentRow, NoInit<SegmentRow>> segments;
    std::vector<StreamRow> streams;
    std::vector<int32_t> stream_of, message_of;
};

// A SEND/WRITE packet of a stream, with what placing it reads of its row in every packet (demux reads the row anyway,
// in capture order; placing it later, stream by stream, would read the 128-byte rows again, strided: placing waited
// on those loads more than it computed).  The rest (RETH, immediate) is read from the row where the opcode has it.
struct Req {
    int64_t psn, frame;
    int64_t payload_off, ll_flag;
    int32_t payload_len;
    uint8_t opcode;
    bool operator<(const Req& o) const { return psn != o.psn ? psn < o.psn : frame < o.frame; }
};

struct Key {
    uint8_t b[36];
    bool operator==(const Key& o) const { return std::memcmp(b, o.b, 36) == 0; }
};
struct KeyHash {  // four 8-byte words and the QPN, each mixed in (a byte-wise FNV loop was 1/4 of reassembly)
    size_t operator()(const Key& k) const {
        uint64_t h = le32(k.b + 32);
        for (int i = 0; i < 32; i += 8) h = (h ^ le64(k.b + i)) * 0x9E3779B97F4A7C15ULL, h ^= h >> 29;
        return size_t(h);
    }
};

int64_t unwrap(int64_t prev, uint32_t psn) {
    int64_t d = int64_t((psn - uint32_t(prev)) & 0xFFFFFF);
    return prev + (d >= 0x800000 ? d - 0x1000000 : d);
}

void count_kind(StreamRow& s, Kind k) {
    int32_t* counter[] = {&s.n_sends, &s.n_writes, &s.n_reads, &s.n_acks, &s.n_ud, &s.n_other};
    ++*counter[k];
}

// Demultiplexes OK packets into (src ip, dst ip, dest QP) streams, one packet at a time: collects each stream's RC
// SEND/WRITE packets (one PSN space) with their PSNs unwrapped in capture order, and each stream's PMTU seen (the
// payload of its FIRST/MIDDLE packets, all full by definition; 0: none), read while the row is in cache rather than
// in another pass over the packet table (two such passes were ~8% of decode CPU).  Stream ids count from 0 in order
// of first appearance; `join` appends another Demux that saw the packets right after this one's.
class Demux {
  public:
    std::vector<StreamRow> streams;
    std::vector<std::vector<Req>> reqs;
    std::vector<int32_t> pmtus;

    // Packet i (its row `r`); returns its stream, -1 when it has none (not OK, or an unknown opcode).
    int32_t add(const PacketRow& r, size_t i) {
        Kind kind = ops.op[r.opcode].kind;
        if (r.status != OK || kind == UNKNOWN) return -1;
        Key k = key(r.src_ip, r.dst_ip, r.dqpn);
        if (last_id_ < 0 || !(k == last_)) {  // consecutive packets mostly belong to one stream: skip the lookup then
            auto found = ids_.try_emplace(k, int32_t(streams.size()));
            last_ = k, last_id_ = found.first->second;
            if (found.second) open(r, i);
        }
        StreamRow& s = streams[size_t(last_id_)];
        s.last_frame = int64_t(i), ++s.n_packets;
        count_kind(s, kind);
        if (kind == SEND || kind == WRITE) {
            std::vector<Req>& q = reqs[size_t(last_id_)];
            q.push_back({q.empty() ? int64_t(r.psn) : unwrap(q.back().psn, r.psn), int64_t(i), r.payload_off, r.ll_flag,
                         r.payload_len, r.opcode});
            const Role role = ops.op[r.opcode].role;
            int32_t& seen = pmtus[size_t(last_id_)];
            if (role == FIRST || role == MIDDLE) seen = std::max(seen, r.payload_len);
        }
        return last_id_;
    }

    // Takes in `later`, which demultiplexed the packets right after this one's: its streams continue this one's of the
    // same key (counts added, requests appended, PSNs unwrapped across the seam) or come after them, in its order.
    // Returns what each of its stream ids became here.
    std::vector<int32_t> join(Demux& later) {
        std::vector<int32_t> id(later.streams.size());
        for (size_t ls = 0; ls < later.streams.size(); ++ls) {
            const StreamRow& x = later.streams[ls];
            auto found = ids_.try_emplace(key(x.src_ip, x.dst_ip, x.dqpn), int32_t(streams.size()));
            const size_t g = size_t(found.first->second);
            id[ls] = int32_t(g);
            if (found.second) {
                streams.push_back(x), reqs.push_back(std::move(later.reqs[ls])), pmtus.push_back(later.pmtus[ls]);
                continue;
            }
            StreamRow& s = streams[g];
            s.last_frame = x.last_frame, s.n_packets += x.n_packets;
            s.n_sends += x.n_sends, s.n_writes += x.n_writes, s.n_reads += x.n_reads, s.n_acks += x.n_acks;
            s.n_ud += x.n_ud, s.n_other += x.n_other;
            pmtus[g] = std::max(pmtus[g], later.pmtus[ls]);
            std::vector<Req>& q = reqs[g];
            std::vector<Req>& more = later.reqs[ls];
            if (!q.empty() && !more.empty()) {  // `later` counted its PSNs from its first request's raw PSN
                const int64_t shift = unwrap(q.back().psn, uint32_t(more.front().psn)) - more.front().psn;
                for (Req& m : more) m.psn += shift;
            }
            q.insert(q.end(), more.begin(), more.end());
        }
        last_id_ = -1;
        return id;
    }

  private:
    static Key key(const uint8_t* src_ip, const uint8_t* dst_ip, uint32_t dqpn) {
        Key k;
        std::memcpy(k.b, src_ip, 16), std::memcpy(k.b + 16, dst_ip, 16), std::memcpy(k.b + 32, &dqpn, 4);
        return k;
    }

    void open(const PacketRow& r, size_t i) {
        StreamRow s{};
        s.first_frame = int64_t(i);
        std::memcpy(s.src_ip, r.src_ip, 16), std::memcpy(s.dst_ip, r.dst_ip, 16);
        std::memcpy(s.src_mac, r.src_mac, 6), std::memcpy(s.dst_mac, r.dst_mac, 6);
        s.dqpn = r.dqpn, s.vlan = r.vlan, s.sport = r.sport, s.ip_version = r.ip_version;
        streams.push_back(s);
        reqs.emplace_back();
        pmtus.push_back(0);
    }

    std::unordered_map<Key, int32_t, KeyHash> ids_;
    Key last_{};
    int32_t last_id_ = -1;
};

// demux reads the packet table in order, but the parse wrote it long before (tens of MB): without fetching rows
// ahead it waited on each row's second line (the opcode) for a third of its time (reassembly -10% with 16 ahead)
constexpr size_t DEMUX_AHEAD = 16;

// Demultiplexes a whole packet table (see Demux) in one pass; each packet's stream goes to stream_of.
Demux demux(const PacketRow* rows, size_t n, int32_t* stream_of) {
    Demux d;
    for (size_t i = 0; i < n; ++i) {
        if (i + DEMUX_AHEAD < n) {  // the table was written by the parse long before: fetch its rows ahead
            const char* ahead = reinterpret_cast<const char*>(rows + i + DEMUX_AHEAD);
            __builtin_prefetch(ahead), __builtin_prefetch(ahead + 64);
        }
        stream_of[i] = d.add(rows[i], i);
    }
    return d;
}

// Places one stream's requests (sorted by PSN, duplicates removed) into messages.
// Boundary rule when a FIRST is lost: the message starts right after the previous message's
// end (its LAST, or the end its RETH length implies); at the very start of a stream nothing is
// known, so offsets count from the first packet seen (START_UNKNOWN).  Packets with no boundary
// between them belong to one message, even across a PSN hole.
class Assembler {
  public:
    // Message ids are indices into out.messages (a stream reassembled on its own counts from 0; see reassemble).
    Assembler(int32_t sid, int32_t pmtu, const PacketRow* rows, StreamTables& out, SegmentSpan& segs, int32_t* message_of)
        : sid_(sid), pmtu_(pmtu), rows_(rows), out_(out), segs_(segs), message_of_(message_of) {}

    void place(const Req& q) {
        const OpInfo& op = ops.op[q.opcode];
        bool starts = op.role == FIRST || op.role == ONLY;
        if (open_ && (starts || op.kind != m_.kind || (end_known_ && q.psn > end_psn_))) close(false, true, q.psn);
        if (!open_) begin(op, q);
        append(op, q);
        if (op.role == LAST || op.role == ONLY) close(true, false, 0);
    }

    // Closes a message the capture ended in; returns the PSN after its end when that is known.
    bool finish(int64_t& end) {
        if (!open_) return false;
        close(false, false, 0);
        const MessageRow& m = out_.messages.back();
        end = m.last_psn + 1;
        return !(m.flags & END_UNKNOWN);
    }

  private:
    int64_t packets_for(int64_t len, bool first) const {
        int64_t k = pmtu_ > 0 ? (len + pmtu_ - 1) / pmtu_ : 1;
        return std::max<int64_t>(k, first ? 2 : 1);  // a FIRST always has a LAST after it
    }

    void begin(const OpInfo& op, const Req& q) {
        m_ = MessageRow{};
        m_.stream = sid_, m_.kind = op.kind, m_.first_opcode = q.opcode, m_.pmtu = pmtu_;
        m_.va = -1, m_.dma_len = -1, m_.first_frame = q.frame, m_.seg_start = segs_.n;
        m_.ll_flag = -1, m_.ll_uniform = 1, prev_flag_ = -1;
        seen_.clear();
        open_ = true, end_known_ = false;
        if (op.role == FIRST || op.role == ONLY) {
            m_.first_psn = q.psn;
            if (op.reth) {
                const PacketRow& r = rows_[q.frame];
                m_.va = int64_t(r.va), m_.rkey = r.rkey, m_.dma_len = r.dma_len;
                end_known_ = true, end_psn_ = q.psn + (op.role == ONLY ? 1 : packets_for(r.dma_len, true)) - 1;
            }
        } else if (prev_known_) {
            m_.first_psn = prev_end_ + 1, m_.flags |= START_INFERRED;
        } else {
            m_.first_psn = q.psn, m_.flags |= START_UNKNOWN;
        }
    }

    void append(const OpInfo& op, const Req& q) {
        int64_t pos = q.psn - m_.first_psn, id = int64_t(out_.messages.size());
        bool full = op.role == FIRST || op.role == MIDDLE;  // must be exactly one PMTU; a LAST at most one
        if ((full && q.payload_len != pmtu_) || (op.role == LAST && q.payload_len > pmtu_)) m_.flags |= BAD_LENGTH;
        int64_t msg_off = pmtu_ > 0 || pos == 0 ? pos * pmtu_ : -1;
        if (msg_off < 0) m_.flags |= BAD_LENGTH;
        if (q.payload_len > 0) {
            segs_.at[segs_.n++] = {q.payload_off, msg_off, q.frame, q.psn, int32_t(id), q.payload_len};
            ++m_.n_segs;
            if (q.ll_flag >= 0 && m_.ll_flag < 0) m_.ll_flag = q.ll_flag;
            if (q.ll_flag >= 0 && prev_flag_ >= 0 && q.ll_flag != prev_flag_) m_.ll_uniform = 0;
            prev_flag_ = q.ll_flag;
        }
        if (op.imm) m_.has_imm = 1, m_.imm = rows_[q.frame].imm;
        seen_.push_back(pos);
        ++m_.n_packets, m_.bytes_seen += q.payload_len, m_.last_opcode = q.opcode;
        m_.first_frame = std::min(m_.first_frame, q.frame), m_.last_frame = std::max(m_.last_frame, q.frame);
        last_seen_psn_ = q.psn, last_seen_end_ = msg_off + q.payload_len;
        message_of_[q.frame] = int32_t(id);
    }

    // next_known: a later packet starts after this message, so it ends at next_psn - 1 at most.
    void close(bool last_seen, bool next_known, int64_t next_psn) {
        if (last_seen) {
            m_.last_psn = last_seen_psn_;
            if (end_known_ && end_psn_ != last_seen_psn_) m_.flags |= BAD_LENGTH;
        } else if (end_known_ || next_known) {
            m_.last_psn = end_known_ ? end_psn_ : next_psn - 1;
            m_.flags |= END_INFERRED;
        } else {
            m_.last_psn = last_seen_psn_, m_.flags |= END_UNKNOWN;
        }
        bool start_seen = !(m_.flags & (START_INFERRED | START_UNKNOWN));
        m_.n_expected = (m_.flags & (START_UNKNOWN | END_UNKNOWN)) ? -1 : int32_t(m_.last_psn - m_.first_psn + 1);
        bool whole = start_seen && last_seen && m_.n_packets == m_.n_expected && !(m_.flags & BAD_LENGTH);
        if (m_.kind == WRITE && whole && m_.bytes_seen != m_.dma_len) m_.flags |= BAD_LENGTH, whole = false;
        if (m_.kind == SEND && whole) m_.dma_len = m_.bytes_seen;
        if (m_.dma_len >= 0 && m_.bytes_seen > m_.dma_len) m_.flags |= BAD_LENGTH;
        m_.complete = whole;
        if (!whole) emit_missing(last_seen);
        prev_known_ = !(m_.flags & END_UNKNOWN), prev_end_ = m_.last_psn;
        out_.messages.push_back(m_);
        open_ = false;
    }

    // Byte ranges of the positions no packet filled; a lost packet k covers [k*pmtu, (k+1)*pmtu).
    void emit_missing(bool last_seen) {
        if (pmtu_ <= 0) return;
        int64_t extent = m_.dma_len >= 0 ? m_.dma_len : last_seen ? last_seen_end_ : -1;
        int64_t n_pos = m_.n_expected >= 0 ? m_.n_expected : seen_.back() + 1;
        int32_t id = int32_t(out_.messages.size());
        size_t s = 0;
        for (int64_t k = 0; k < n_pos; ++k) {
            while (s < seen_.size() && seen_[s] < k) ++s;
            if (s < seen_.size() && seen_[s] == k) continue;
            int64_t a = k * pmtu_, b = extent >= 0 ? std::min<int64_t>(extent, a + pmtu_) : a + pmtu_;
            if (a >= b) continue;
            if (!out_.missing.empty() && out_.missing.back().message == id && out_.missing.back().end == a)
                out_.missing.back().end = b;
            else
                out_.missing.push_back({a, b, id, 0});
        }
        if (m_.flags & END_UNKNOWN) out_.missing.push_back({last_seen_end_, -1, id, 0});
    }

    int32_t sid_, pmtu_;
    const PacketRow* rows_;
    StreamTables& out_;
    SegmentSpan& segs_;
    int32_t* message_of_;
    MessageRow m_{};
    std::vector<int64_t> seen_;  // packet positions in the open message, increasing
    bool open_ = false, end_known_ = false, prev_known_ = false;
    int64_t end_psn_ = 0, prev_end_ = 0, last_seen_psn_ = 0, last_seen_end_ = 0;
    int64_t prev_flag_ = -1;  // ll_flag of the open message's last segment
};

void assemble_stream(int32_t sid, StreamRow& s, std::vector<Req>& q, const PacketRow* rows, int32_t pmtu, StreamTables& out,
                     SegmentSpan& segs, int32_t* message_of) {
    if (!std::is_sorted(q.begin(), q.end())) std::sort(q.begin(), q.end());  // by PSN; equal PSNs keep capture order: the first copy wins
    s.pmtu = pmtu;
    size_t first_message = out.messages.size();
    Assembler a(sid, pmtu, rows, out, segs, message_of);
    int64_t expected = 0;
    bool any = false;
    for (const Req& x : q) {
        if (any && x.psn < expected) { ++s.n_duplicates; continue; }
        if (any && x.psn > expected) out.gaps.push_back({expected, x.psn, sid, HOLE});
        a.place(x);
        expected = x.psn + 1, any = true;
    }
    int64_t end = 0;
    if (a.finish(end) && end > expected) out.gaps.push_back({expected, end, sid, TAIL});
    s.n_requests = int32_t(q.size()) - s.n_duplicates;
    s.n_messages = int32_t(out.messages.size() - first_message);
    s.psn_first = any ? q.front().psn : -1, s.psn_last = any ? expected - 1 : -1;
}

// Streams are independent once demultiplexed: with `workers` > 1 each thread reassembles whole streams, each into
// its own tables (message ids from 0) and its own room in the segment table; then the ids are shifted (segments
// and message_of on the threads again, by stream and by frame range) and the rest concatenated in stream order, so the
// result is the same as one thread's.  (Copying the segments out of per-stream tables instead cost as much as
// reassembling them: on 2 threads it was slower than one.)
// `seen`: each stream's PMTU from demux (used when `pmtu` is 0).
void assemble_streams(std::vector<std::vector<Req>>& reqs, const PacketRow* rows, int32_t pmtu,
                      const std::vector<int32_t>& seen, Out& out, int workers) {
    int32_t fallback = pmtu;  // a stream without FIRST/MIDDLE packets borrows the capture's PMTU
    if (!pmtu)
        for (int32_t own : seen) fallback = std::max(fallback, own);
    auto pmtu_of = [&](size_t s) {
        int32_t own = pmtu ? pmtu : seen[s];
        return own ? own : fallback;
    };
    const size_t ns = reqs.size();
    std::vector<int64_t> room(ns + 1, 0);  // stream s may write segment rows [room[s], room[s + 1]): one per request
    for (size_t s = 0; s < ns; ++s) room[s + 1] = room[s] + int64_t(reqs[s].size());
    out.segments.resize(size_t(room[ns]));
    SegmentRow* segs = out.segments.data();
    int32_t* message_of = out.message_of.data();
    if (workers <= 1 || ns < 2) {
        SegmentSpan all{segs};
        for (size_t s = 0; s < ns; ++s) assemble_stream(int32_t(s), out.streams[s], reqs[s], rows, pmtu_of(s), out, all, message_of);
        out.segments.resize(size_t(all.n));
        return;
    }
    // largest streams first, each onto the least loaded thread
    std::vector<size_t> order(ns);
    for (size_t s = 0; s < ns; ++s) order[s] = s;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return reqs[a].size() > reqs[b].size(); });
    const size_t k = std::min<size_t>(size_t(workers), ns);
    std::vector<std::vector<size_t>> mine(k);
    std::vector<size_t> load(k, 0);
    for (size_t s : order) {
        size_t t = size_t(std::min_element(load.begin(), load.end()) - load.begin());
        mine[t].push_back(s), load[t] += reqs[s].size() + 1;
    }
    struct alignas(64) Part : StreamTables {  // a stream's tables on cache lines of their own
        int64_t used = 0;  // its segment rows
    };
    std::vector<Part> parts(ns);
    auto on_threads = [k](auto&& work) {
        Joined threads;
        for (size_t t = 1; t < k; ++t) threads.start(work, t);
        work(size_t(0));
    };
    on_threads([&](size_t t) {
        for (size_t s : mine[t]) {
            SegmentSpan own{segs + room[s]};
            assemble_stream(int32_t(s), out.streams[s], reqs[s], rows, pmtu_of(s), parts[s], own, message_of);
            parts[s].used = own.n;
        }
    });
    std::vector<int32_t> mbase(ns + 1, 0);
    for (size_t s = 0; s < ns; ++s) mbase[s + 1] = mbase[s] + int32_t(parts[s].messages.size());
    const size_t n = out.message_of.size();
    const int32_t* stream_of = out.stream_of.data();
    on_threads([&](size_t t) {
        for (size_t s : mine[t])
            for (SegmentRow* g = segs + room[s]; g < segs + room[s] + parts[s].used; ++g) g->message += mbase[s];
        for (size_t i = n * t / k; i < n * (t + 1) / k; ++i)
            if (message_of[i] >= 0) message_of[i] += mbase[size_t(stream_of[i])];
    });
    size_t nmiss = 0, ngap = 0;
    for (const Part& p : parts) nmiss += p.missing.size(), ngap += p.gaps.size();
    out.messages.reserve(size_t(mbase[ns])), out.missing.reserve(nmiss), out.gaps.reserve(ngap);
    int64_t at = 0;  // where stream s's segments start in the result: its room, less what the ones before left unused
    for (size_t s = 0; s < ns; ++s) {
        Part& p = parts[s];
        if (at != room[s]) std::memmove(segs + at, segs + room[s], size_t(p.used) * sizeof(SegmentRow));
        for (MessageRow m : p.messages) m.seg_start += at, out.messages.push_back(m);
        for (MissingRow m : p.missing) m.message += mbase[s], out.missing.push_back(m);
        out.gaps.insert(out.gaps.end(), p.gaps.begin(), p.gaps.end());
        at += p.used;
    }
    out.segments.resize(size_t(at));
}

py::dict tables(Out&& out) {
    py::dict d;
    d["streams"] = adopt<uint8_t>(std::move(out.streams)), d["messages"] = adopt<uint8_t>(std::move(out.messages));
    d["segments"] = adopt<uint8_t>(std::move(out.segments)), d["missing"] = adopt<uint8_t>(std::move(out.missing));
    d["gaps"] = adopt<uint8_t>(std::move(out.gaps));
    d["stream_of"] = adopt<int32_t>(std::move(out.stream_of)), d["message_of"] = adopt<int32_t>(std::move(out.message_of));
    return d;
}

void check_reassembly_args(int32_t pmtu, int workers) {
    if (pmtu < 0) throw py::value_error("pmtu must be >= 0 (0 = infer from the packets)");
    if (workers < 1 || workers > 256) throw py::value_error("workers must be 1..256, got " + std::to_string(workers));
}
}  // namespace

py::dict reassemble(const py::buffer& packets, int32_t pmtu, int workers) {
    Bytes b = readable(packets, sizeof(PacketRow));
    const PacketRow* rows = reinterpret_cast<const PacketRow*>(b.data);
    size_t n = b.size / sizeof(PacketRow);
    check_reassembly_args(pmtu, workers);
    Out out;
    {
        py::gil_scoped_release nogil;
        out.stream_of.resize(n), out.message_of.assign(n, -1);
        Demux d = demux(rows, n, out.stream_of.data());
        out.streams = std::move(d.streams);
        assemble_streams(d.reqs, rows, pmtu, d.pmtus, out, workers);
    }
    return tables(std::move(out));
}

// parse, then reassemble, of the same frames (the same table, counts and tables) in one call, the demultiplexing done
// by the parse's threads: each of `ranges` threads parses a contiguous run of frames and hands every row to its own
// Demux while the row is in cache; the runs' Demuxes are then joined in capture order.  Separately, the demux read the
// whole packet table again (tens of MB, written long before) on one thread.  Returns (counts, tables).
py::tuple parse_reassemble(const py::buffer& buf, const py::buffer& offsets, const py::buffer& lengths, py::buffer& out,
                           bool check_icrc, int32_t pmtu, int ranges, int workers) {
    FrameTable t = frame_table(buf, offsets, lengths, out);
    check_reassembly_args(pmtu, workers);
    if (ranges < 1 || ranges > 256) throw py::value_error("ranges must be 1..256, got " + std::to_string(ranges));
    const size_t k = std::min<size_t>(size_t(ranges), std::max<size_t>(t.n, 1));
    py::array_t<int64_t> counts{py::ssize_t(N_COUNTS)};
    int64_t* cnt = counts.mutable_data();
    Out o;
    {
        py::gil_scoped_release nogil;
        o.stream_of.resize(t.n), o.message_of.assign(t.n, -1);
        // a thread's own cache lines: with the Demuxes side by side, one thread's writes of its last stream key
        // evicted the line the other read its vectors from on every packet (the parse on 2 threads took 1/3 longer)
        struct alignas(64) Part {
            Demux demux;
            alignas(64) std::array<int64_t, N_COUNTS> counts{};
        };
        std::vector<Part> parts(k);
        auto work = [&](size_t p) {
            int32_t* stream_of = o.stream_of.data();
            Demux& d = parts[p].demux;
            parse_frames(t, t.n * p / k, t.n * (p + 1) / k, check_icrc, parts[p].counts.data(),
                         [&](const PacketRow& r, size_t i) { stream_of[i] = d.add(r, i); });
        };
        {
            Joined threads;
            for (size_t p = 1; p < k; ++p) threads.start(work, p);
            work(0);
        }
        std::fill(cnt, cnt + N_COUNTS, 0);
        for (const Part& part : parts)
            for (size_t j = 0; j < N_COUNTS; ++j) cnt[j] += part.counts[j];
        Demux& all = parts[0].demux;
        for (size_t p = 1; p < k; ++p) {
            const std::vector<int32_t> id = all.join(parts[p].demux);
            for (size_t i = t.n * p / k; i < t.n * (p + 1) / k; ++i)
                if (o.stream_of[i] >= 0) o.stream_of[i] = id[size_t(o.stream_of[i])];
        }
        o.streams = std::move(all.streams);
        assemble_streams(all.reqs, t.rows, pmtu, all.pmtus, o, workers);
    }
    return py::make_tuple(counts, tables(std::move(o)));
}

}  // namespace mirror
