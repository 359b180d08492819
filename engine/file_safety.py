"""The two rules every file the engine touches obeys (DESIGN.md, "Hostile input").

Writing. ``check_write_target(path)`` refuses a target that exists and is not a regular file
(a FIFO, a character or block device, a socket; a symlink is judged by what it points to):
a write through ``engine.archive.atomic_write`` renames a new file over its target, which
would replace ``/dev/null`` itself under root, and an append would block forever on a FIFO
without a reader. A directory is refused too, unless the writer makes files inside it
(``directory=True``: TensorBoard's log folder). Every writer calls it before writing.

Reading. ``SizeBudget`` is what reading one file may allocate: about the file's own size.
A reader opens one for the file (``SizeBudget.of_file``) and charges it with every size the
file declares (an archive entry, a tensor's shape, an architecture's parameters, a value a
graph computes) before allocating it; a declaration beyond what remains is a ``ValueError``
naming the file, what declared it and both sizes. So a small file that declares a large
array is refused before the array exists, and reading costs time linear in the file.
"""
import os
import stat

# what any file may cost beside its own bytes: a header, a config's Python objects, a small
# computed value; a real file pays for itself many times over before this matters
SLACK_BYTES = 1 << 20

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"))


def special_kind(path):
    """What ``path`` is, in words, when it exists and is not a regular file (symlinks
    followed); None for a regular file or nothing."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_write_target(path, directory=False):
    """Raise ``OSError`` unless writing ``path`` creates or replaces a regular file (or, with
    ``directory``, writes into a folder): an existing FIFO, device, socket or (for a file)
    directory is refused, as is a symlink to one; nothing is changed."""
    path = os.fspath(path)
    kind = special_kind(path)
    if kind is None or (directory and kind == "a directory"):
        return
    real = os.path.realpath(path)
    shown = path if real == os.path.abspath(path) else f"{path} (a link to {real})"
    wanted = "a folder" if directory else "a regular file"
    raise OSError(21 if kind == "a directory" else 22,
                  f"{shown} is {kind}, not {wanted}: the engine writes only regular files and "
                  "never replaces anything else; give another path", path)


class SizeBudget:
    """The bytes reading one file may allocate (``limit``: its size plus ``SLACK_BYTES``);
    ``charge`` spends them, ``remaining`` is what is left."""

    def __init__(self, name, size, slack=SLACK_BYTES):
        self.name, self.size = name, int(size)
        self.limit = self.size + slack
        self.spent = 0

    @classmethod
    def of_file(cls, file, name=None, slack=SLACK_BYTES):
        """The budget of an open file or a path (its size on disk)."""
        if isinstance(file, (str, bytes, os.PathLike)):
            return cls(name or os.fspath(file), os.path.getsize(file), slack)
        return cls(name or getattr(file, "name", "<file>"), os.fstat(file.fileno()).st_size,
                   slack)

    @property
    def remaining(self):
        return self.limit - self.spent

    def charge(self, nbytes, what):
        """Spend ``nbytes`` on ``what`` (words for the message), or raise ``ValueError``
        when they exceed what remains: the file declares more than it can hold."""
        nbytes = int(nbytes)
        if nbytes < 0 or nbytes > self.remaining:
            raise ValueError(f"{self.name}: {what} needs {nbytes:,} bytes, but it holds "
                             f"{self.size:,} bytes ({max(self.remaining, 0):,} not yet spent): "
                             "the file is damaged or crafted")
        self.spent += nbytes
        return nbytes
