#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
python3 -c 'b = bytearray(200 * 1024 * 1024); b[::4096] = b"x" * len(b[::4096]); print(len(b))' && [ "$(nproc)" -ge 1 ]
reward $?
