#!/usr/bin/env python3
"""Writes a paged KV cache's block table and lengths as int32 .npy files, for
`attnc bench examples/paged_decode.attn --input block_table=TABLE --input lens=LENS`
(bench/paged_decode.sh): B sequences of LEN tokens each in pages of P tokens, every sequence's
pages distinct and drawn in a shuffled order (seeded) from a pool of B·ceil(LEN/P) pages. Needs
no NumPy.

    python3 bench/write_pages.py TABLE.npy LENS.npy B LEN P
"""

import random
import struct
import sys


def write_i32(path, shape, values):
    dims = "".join(f"{d}," if len(shape) == 1 else f"{d}, " for d in shape).rstrip(" ")
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': (%s), }" % dims
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%di" % len(values), *values))


def main() -> None:
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    b, n, p = (int(x) for x in sys.argv[3:])
    per = -(-n // p)
    pool = list(range(b * per))
    random.Random(0).shuffle(pool)
    write_i32(sys.argv[1], [b, per], pool)
    write_i32(sys.argv[2], [b], [n] * b)


if __name__ == "__main__":
    main()
