from collections.abc import Buffer

def pwrite_all(fd: int, buffer: Buffer, offset: int = 0, flush_every: int = 0) -> int:
    """Write the whole buffer at offset; start write-back every flush_every bytes."""

def copy_into(dst: Buffer, src: Buffer, threads: int = 4, stream: bool = False) -> None:
    """Copy src into dst (same byte size) with up to `threads` threads; stream: non-temporal stores."""

def sync_filesystem(fd: int) -> None:
    """syncfs(fd): make every dirty page and inode of fd's filesystem durable."""

def generation_load(buffer: Buffer, offset: int) -> int:
    """Atomically read the 64-bit counter at offset (8-aligned), fenced on both sides."""

def generation_store(buffer: Buffer, offset: int, value: int) -> None:
    """Atomically write the 64-bit counter at offset (8-aligned), fenced on both sides."""
