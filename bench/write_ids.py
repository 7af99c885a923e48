#!/usr/bin/env python3
"""Writes the per-token sequence ids of a packed ragged batch as an int32 .npy file (sequence 0
for its first LEN tokens, then 1, ...), for `attnc bench --input seq=FILE` (bench/varlen.sh,
bench/gpu_session.sh serving). Needs no NumPy.

    python3 bench/write_ids.py OUT.npy LEN [LEN ...]
"""

import struct
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    lens = [int(x) for x in sys.argv[2:]]
    ids = [s for s, n in enumerate(lens) for _ in range(n)]
    header = "{'descr': '<i4', 'fortran_order': False, 'shape': (%d,), }" % len(ids)
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(sys.argv[1], "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%di" % len(ids), *ids))


if __name__ == "__main__":
    main()
