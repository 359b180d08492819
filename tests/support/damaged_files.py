"""Files damaged on purpose, for the tests that every reader refuses them cleanly."""


def each_flipped_byte(content, damaged):
    """For each position of ``content`` (bytes), ``damaged`` (a path) holds ``content`` with
    that one byte flipped: yields the position."""
    for position in range(len(content)):
        flipped = bytearray(content)
        flipped[position] ^= 0xFF
        damaged.write_bytes(bytes(flipped))
        yield position
