from collections.abc import Buffer

def pwrite_all(fd: int, buffer: Buffer, offset: int = 0, flush_every: int = 0) -> int:
    """Write the whole buffer at offset; start write-back every flush_every bytes."""

def copy_into(dst: Buffer, src: Buffer, threads: int = 4, stream: bool = False) -> None:
    """Copy src into dst (same byte size) with up to `threads` threads; stream: non-temporal stores."""

def sync_filesystem(fd: int) -> None:
    """syncfs(fd): make every dirty page and inode of fd's filesystem durable."""

def crc32c(buffer: Buffer, crc: int = 0) -> int:
    """CRC-32C of the buffer, continued from crc (google_crc32c.extend's value)."""

def xxh3_128(buffer: Buffer) -> str:
    """xxh3-128 of the buffer as hex (xxhash's hexdigest)."""

class ChunkWriter:
    """Streams one dense zarr shard file of fixed-size inner chunks (crc32c after each, index at the end) to fd
    from offset 0, hashing the data and the file as it writes (GIL released). The fd stays the caller's."""

    def __init__(self, fd: int, chunk_bytes: int, flush_every: int = 0, bound_dirty: bool = False) -> None:
        """flush_every > 0: write-back of every flush_every bytes starts once they are written; bound_dirty: the
        writer then waits for the write-back of the window before (about two windows of the file dirty at most)."""
    def write(self, buffer: Buffer, hash: bool = True) -> str:
        """Append the buffer's bytes to the chunk stream; returns their xxh3-128 (hex), or '' when hash is False
        (the caller hashed them already). Raises OSError."""
    def finish(self) -> tuple[int, str]:
        """Pad the last chunk with zeros, write the index; returns (file bytes, xxh3-128 hex of the file)."""

def read_chunks(fd: int, dst: Buffer, begin: int, chunk_bytes: int, threads: int = 1,
                block_bytes: int = 524288) -> str:
    """Read data bytes [begin, begin + len(dst)) of a dense shard file into dst, checking the crc32c of every chunk
    touched (parts of >= 16 MiB on up to `threads` threads); returns the xxh3-128 (hex) of dst.
    OSError for I/O, ValueError for a bad or short file."""

def generation_load(buffer: Buffer, offset: int) -> int:
    """Atomically read the 64-bit counter at offset (8-aligned), fenced on both sides."""

def generation_store(buffer: Buffer, offset: int, value: int) -> None:
    """Atomically write the 64-bit counter at offset (8-aligned), fenced on both sides."""
