"""A background process's stdout and stderr, in one file its tests read while it runs."""
import os
import tempfile


class ChildLog:
    """Pass `file` as the child's stdout. The child appends (O_APPEND: every
    write lands at the end) and text() reads with pread: the file offset is
    shared with the child, and a seek here could make the child's next write
    land over the log's beginning."""

    def __init__(self):
        self.file = tempfile.TemporaryFile(mode="ab")

    def text(self):
        fd, chunks, offset = self.file.fileno(), [], 0
        while True:
            chunk = os.pread(fd, 1 << 20, offset)
            if not chunk:
                return b"".join(chunks).decode(errors="replace")
            chunks.append(chunk)
            offset += len(chunk)
