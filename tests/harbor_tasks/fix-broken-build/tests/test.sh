#!/bin/bash
reward() {
  mkdir -p /logs/verifier
  if [ "$1" = 0 ]; then echo 1 > /logs/verifier/reward.txt; echo PASS; else echo 0 > /logs/verifier/reward.txt; echo FAIL; fi
}
cd /app && ./build.sh > /tmp/build.out 2>&1
grep -qx 'built: 3 modules, answer 42' /tmp/build.out
reward $?
