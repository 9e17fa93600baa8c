// flowcheck._mirror: the mirror-capture packet path — index a capture file, parse RoCEv2 frames, reassemble RDMA
// messages by PSN, unpack NCCL lines, merge final sends, copy PACKET_MMAP blocks.  This file is the module's table;
// each call lives in the file api.hpp names.
//
// Buffers in, numpy arrays out, the GIL released around every loop, one error type (ValueError) for bad arguments and
// malformed files (Python wraps it in CaptureError).  The record layouts are C structs (records.hpp); `layouts()`
// describes them so Python builds matching numpy dtypes instead of restating the offsets.
#include "api.hpp"
#include "bytes.hpp"
#include "crc.hpp"

using namespace mirror;

PYBIND11_MODULE(_mirror, m) {
    crc_init();
    m.doc() = "flowcheck's mirror-capture packet path: capture index, RoCEv2 parse, reassembly, NCCL unpacking.";
    m.def("layouts", &layouts, "Record layouts: {name: ([(field, numpy format, offset)], itemsize)}.");
    m.def("crc32", &crc32, py::arg("data"), py::arg("value") = 0, "zlib-compatible CRC32 of data, continuing from value.");
    m.def("crc_path", &crc_path_name,
          "The CRC32 folding in use: vpclmul, pclmul or table (the CPU's widest, capped by $FLOWCHECK_CRC).");
    m.def("index_capture", &index_capture, py::arg("file"),
          "Index a pcap/pcapng image: (offsets, lengths, ts_ns, linktypes, format). ValueError when malformed.");
    m.def("parse", &parse, py::arg("buf"), py::arg("offsets"), py::arg("lengths"), py::arg("out"),
          py::arg("check_icrc") = true, "Parse every frame into the packet table `out` (one row per frame); returns the frames per status (4) "
          "then per opcode (256, frames with a BTH).");
    m.def("frame_icrc", &frame_icrc, py::arg("frame"), "The ICRC a RoCEv2 frame should carry, or -1 if it is not one.");
    m.def("parse_reassemble", &parse_reassemble, py::arg("buf"), py::arg("offsets"), py::arg("lengths"), py::arg("out"),
          py::arg("check_icrc") = true, py::arg("pmtu") = 0, py::arg("ranges") = 1, py::arg("workers") = 1,
          "parse into `out`, then reassemble, in one call: each of `ranges` threads parses a run of frames and "
          "demultiplexes its rows as it goes; `workers` threads reassemble streams. Returns (counts, tables).");
    m.def("reassemble", &reassemble, py::arg("packets"), py::arg("pmtu") = 0, py::arg("workers") = 1,
          "Streams, messages, segments, missing byte ranges, PSN gaps from a packet table (whole streams on `workers` "
          "threads; the tables do not depend on it).");
    m.def("ll_unpack", &ll_unpack, py::arg("buf"), py::arg("segments"), py::arg("out"), py::arg("expected_flag") = -1,
          "Copy LL data words of the segments into out; returns (flag, lines, bad_lines).");
    m.def("ll128_unpack", &ll128_unpack, py::arg("buf"), py::arg("segments"), py::arg("out"),
          py::arg("expected_flag") = -1, "Copy LL128 data of the segments into out; returns (flag, lines, bad_lines).");
    m.def("merge_send", &merge_send, py::arg("buf"), py::arg("parts"), py::arg("flag"), py::arg("ll"), py::arg("data"),
          py::arg("copies"), "Place a final send's parts into an allreduce's data/copies slices; (seen, differing, unplaced).");
    m.def("merge_sends", &merge_sends, py::arg("jobs"),
          "merge_send over a list of (buf, parts, flag, ll, data, copies) jobs in order, the GIL released once; "
          "one (seen, differing, unplaced) per job.");
    m.def("merge_rows", &merge_rows, py::arg("buf"), py::arg("segments"), py::arg("rows"), py::arg("ll"), py::arg("data"),
          py::arg("copies"),
          "merge_send of sends given as (seg_start, seg_end, shift, flag, lo, hi) rows over one segments table and one "
          "allreduce's data/copies; (seen, differing, [(row, status, bytes)]).");
    m.def("segment_flags", &segment_flags, py::arg("buf"), py::arg("segments"),
          "The LL flag of every segment's first line, -1 for segments under 16 bytes.");
    m.def("ring_block", &ring_block, py::arg("block"), py::arg("out"), py::arg("at"), py::arg("offsets"),
          py::arg("lengths"), py::arg("ts_ns"), py::arg("row"),
          "Copy the frames of a retired TPACKET_V3 block to out[at:] (VLAN tags put back, outgoing skipped); "
          "(rows after, out offset after).");
    m.def("simple_copy", &simple_copy, py::arg("buf"), py::arg("segments"), py::arg("out"),
          "Copy the raw payload of the segments into out at their message offsets; returns bytes copied.");
}
