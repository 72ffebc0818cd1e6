#!/bin/bash
python3 -c 'b = bytearray(200 * 1024 * 1024); b[::4096] = b"x" * len(b[::4096])' && echo done > /app/alloc.txt
